"""Run tests/gpu against the vLLM installed here and write one JSON report.

    python tools/run_gpu_tests.py --out gpu-report.json [-- pytest args, test files]

What ``nox -s gpu`` runs after it has installed vLLM; on a GPU host that cannot reach
PyPI, install vLLM by other means and run this directly. The report holds the versions
(vLLM, torch, CUDA, GPU), the pytest outcome of every test, and the per-test records the
tests write (states compared, tolerances, timings: ``VLLM_COMPAT_GPU_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, object]:
    code = ("import json, torch, vllm, vllm_compat; d = vllm_compat.detect(); print(json.dumps({"
            "'vllm': vllm.__version__, 'adapter': d.era, 'torch': torch.__version__,"
            "'cuda': torch.version.cuda, 'gpus': [torch.cuda.get_device_name(i) for i in "
            "range(torch.cuda.device_count())]}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["environment probe failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def outcomes(junit: Path) -> list[dict[str, object]]:
    if not junit.exists():
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, detail = {"failure": "failed"}.get(tag, tag), el.get("message")
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0), "detail": detail})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON report to write")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-compat-gpu-"))
    junit, records = tmp / "junit.xml", tmp / "records.jsonl"
    env = dict(os.environ, VLLM_COMPAT_GPU_RESULTS=str(records))
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # greedy tests never reach it; no JIT
    t0 = time.monotonic()
    # test files or folders among the arguments replace the default, the whole tests/gpu
    paths = [x for x in a.pytest_args if not x.startswith("-") and (ROOT / x.split("::")[0]).exists()]
    targets = [] if paths else [str(ROOT / "tests" / "gpu")]
    rc = subprocess.run([sys.executable, "-m", "pytest", *targets, "-m", "gpu",
                         "-p", "no:cacheprovider", f"--junitxml={junit}", *a.pytest_args],
                        cwd=ROOT, env=env).returncode
    rows = outcomes(junit)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    report = {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.monotonic() - t0, 1), "pytest_exit_code": rc,
              "environment": environment(), "counts": counts, "tests": rows,
              "records": [json.loads(x) for x in records.read_text().splitlines() if x.strip()]
              if records.exists() else []}
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{counts} -> {a.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
