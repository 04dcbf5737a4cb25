"""``vllm-compat`` command line: ``doctor`` reports what vllm_compat sees."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from . import __version__
from .errors import VllmCompatError


def _doctor(args: argparse.Namespace) -> int:
    from .detect import detect

    try:
        info = detect()
    except VllmCompatError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc), "error_type": type(exc).__name__}))
        else:
            print(f"vllm-compat {__version__}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"ok": True, "vllm_compat": __version__, **info.as_dict()}, indent=2))
        return 0
    print(f"vllm-compat {__version__}")
    print(f"vLLM        {info.version} (base {info.base_version}"
          f"{', pre-release' if info.is_prerelease else ''}{', local ' + info.local if info.local else ''})")
    print(f"era         {info.era}: {info.era_summary}")
    print(f"routing     {info.routing}")
    if info.newer_than_tested:
        print("warning     newer than the newest tested release; VLLM_COMPAT_STRICT=1 refuses it")
    print(f"runner      {info.runner}")
    print("capabilities:")
    width = max(len(k) for k in info.probes)
    for k, v in info.probes.items():
        print(f"  {k:<{width}}  {'yes' if v else 'no'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-compat", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vllm-compat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="installed vLLM version, era, runner, capabilities")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)
    from .eagle3.cli import add_parser as add_eagle3_parser  # `vllm-compat eagle3 <step>`

    add_eagle3_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
