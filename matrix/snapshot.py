"""Write the probe and surface snapshot of the installed vLLM (run inside a release's env).

    python matrix/snapshot.py [--out-dir DIR]

Writes ``<DIR>/<vLLM version>.json`` (default: ``src/vllm_compat/snapshots``): what the resolver
finds of every symbol of ``vllm_compat.surface``, every probe value, and the engine's block
hashes of fixed probe requests per hash algorithm (``hash_fingerprint``), the record that
``vllm-compat doctor --drift`` compares an untested build with. ``nox -s conformance`` runs it
for each release; ``nox -s "snapshot(vllm='X')"`` only introspects (no tests).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def record() -> dict:
    from vllm_compat import hash_check
    from vllm_compat import resolve as _resolve

    rec = {"vllm": importlib.metadata.version("vllm"), "probes": _resolve.probe_values(),
           "surface": _resolve.survey()}
    # the engine's block hashes of fixed probe requests per algorithm: doctor --drift tells a
    # build that hashes otherwise than this release (absent where it cannot be computed)
    try:
        rec["hash_fingerprint"] = hash_check.fingerprint()
    except Exception as exc:  # noqa: BLE001 - recorded as not recorded, never a failure
        print(f"hash fingerprint not recorded: {type(exc).__name__}: {exc}")
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "src" / "vllm_compat" / "snapshots")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    rec = record()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{rec['vllm']}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    missing = [k for k, row in rec["surface"].items() if row["status"] == "missing"]
    drifted = [k for k, row in rec["surface"].items()
               if row.get("new_required") or row.get("removed") or row.get("contract")]
    print(f"wrote {path}: {len(rec['surface'])} symbols, missing {missing or 'none'}, "
          f"signature/return drift {drifted or 'none'}, probes {rec['probes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
