"""Chart of bench.gpu_extraction results: tok/s per mode, every run, ceiling and disk limits.

    python -m bench.plot_gpu_extraction OUT/gpu_extraction-llama-1b.json [more.json]
        [--out OUT/gpu_extraction.png]

One panel per JSON (model); per workload a group of bars (best run) with each run as a dot;
dashed lines: the compute ceiling (2 x params FLOPs/token at the peak TFLOP/s) and, per dtype,
the tok/s at which the disk's own sequential write + fsync would absorb the states; under
each group, the to-disk ratio c / min(b, disk) per dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (series, label) in plotting order; missing series are left out.
SERIES = [
    ("a", "(a) vLLM generate"),
    ("b", "(b) ours, host mem"),
    ("b_ahead", "(b) ours, launch ahead"),
    ("b_lockstep", "(b) lockstep loop"),
    ("b_sync", "(b) blocking copy"),
    ("a_sync", "(a) in-process, sync"),
    ("c_bf16", "(c) ours, disk bf16"),
    ("c_fp8", "(c) ours, disk fp8"),
    ("c_fp8_cpu", "(c) ours, disk fp8 encoded on CPU"),
    ("d", "(d) HF forward"),
    ("e_returned", "(e) vLLM native, returned"),
    ("e_drained", "(e) vLLM native, drained"),
]


def _load(p: str | Path | dict[str, Any]) -> dict[str, Any]:
    return p if isinstance(p, dict) else json.loads(Path(p).read_text())


def _series(res: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for mode in (res.get("modes") or {}).values():
        for name, per in (mode.get("series") or {}).items():
            out[name] = {wl: [r["tok_s"] for r in runs if r.get("tok_s")]
                         for wl, runs in per.items()}
    return out


def plot(results: Sequence[str | Path | dict[str, Any]], out: str | Path) -> Path:
    """Render ``results`` (JSON paths or dicts) into the PNG ``out``; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [_load(r) for r in results]
    fig, axes = plt.subplots(len(data), 1, figsize=(11, 4.2 * len(data)), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, res in zip(axes[:, 0], data):
        ser = _series(res)
        wls = list(res.get("workloads") or {})
        present = [(k, lab) for k, lab in SERIES if k in ser]
        width = 0.8 / max(1, len(present))
        for j, (key, label) in enumerate(present):
            xs, best = [], []
            for i, wl in enumerate(wls):
                runs = ser[key].get(wl) or []
                x = i + (j - (len(present) - 1) / 2) * width
                xs.append(x)
                best.append(max(runs) if runs else 0.0)
                ax.scatter([x] * len(runs), runs, s=10, color="black", zorder=3)
            ax.bar(xs, best, width * 0.95, label=label, color=colors[j % len(colors)])
            for x, y in zip(xs, best):
                if y:
                    ax.text(x, y, f"{y / 1e3:,.1f}k", ha="center", va="bottom", fontsize=6)
        tops = [v for s in ser.values() for runs in s.values() for v in runs]
        top = max(tops) if tops else 0.0
        ceil = (res.get("ceiling") or {}).get("tok_s")
        if ceil and (not top or ceil > 3 * top):  # off the chart: say so in the title
            ceil_note, ceil = f" | ceiling {ceil:,.0f} tok/s (off scale)", None
        else:
            ceil_note = ""
        if ceil:
            ax.axhline(ceil, ls="--", color="grey", lw=1)
            ax.text(len(wls) - 0.5, ceil, f" compute ceiling {ceil / 1e3:,.0f}k", va="bottom",
                    ha="right", fontsize=8, color="grey")
        ymax = max(top, ceil or 0.0)
        for dt, col in (("disk_bf16", "tab:red"), ("disk_fp8", "tab:purple")):
            for i, wl in enumerate(wls):
                runs = (ser.get(dt) or {}).get(wl) or []
                if runs and (not top or max(runs) <= 3 * top):
                    y = max(runs)
                    ymax = max(ymax, y)
                    ax.hlines(y, i - 0.45, i + 0.45, colors=col, linestyles=":", lw=1.2)
                    ax.text(i + 0.45, y, f" disk {dt[5:]} {y / 1e3:,.0f}k", fontsize=7,
                            color=col, va="bottom", ha="right")
        limits = (res.get("summary") or {}).get("c_limits") or {}
        for i, wl in enumerate(wls):
            parts = [f"{dt} {lim[wl]['c_over_binding']:.2f}" for dt, lim in limits.items()
                     if (lim.get(wl) or {}).get("c_over_binding")]
            if parts:
                ax.text(i, 0.8, "to disk, c / min(b, disk): " + " · ".join(parts),
                        ha="center", va="bottom", fontsize=7, transform=ax.get_xaxis_transform(),
                        bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
        env = res.get("env") or {}
        ax.set_title(f"{res.get('model')}: layers {res.get('layer_ids')} | {env.get('gpu')} | "
                     f"vLLM {env.get('vllm')} | torch {env.get('torch')}{ceil_note}", fontsize=9)
        ax.set_xticks(range(len(wls)))
        ax.set_xticklabels([f"{wl}\n{(res['workloads'][wl]['prompts'])} prompts, "
                            f"{res['workloads'][wl]['tokens']:,} tokens" for wl in wls])
        ax.set_ylabel("prompt tokens / s")
        if ymax:
            ax.set_ylim(0, 1.3 * ymax)  # room for the legend
        ax.legend(fontsize=7, ncol=4, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", help="PNG path (default: beside the first JSON)")
    a = ap.parse_args(argv)
    out = a.out or (str(Path(a.json[0]).with_suffix(".png")) if len(a.json) == 1
                    else str(Path(a.json[0]).parent / "gpu_extraction.png"))
    print(plot(a.json, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
