"""``vllm-compat`` command line: ``doctor`` reports what vllm_compat sees; ``eagle3 <step>``
runs the draft pipeline; ``serve-hidden-states`` serves hidden states to speculators 0.5-0.9.

``vllm-compat doctor --drift`` adds the drift report (the installed vLLM against the surface
vllm_compat relies on and the nearest tested release). It always prints the report, and exits
1 when a change affects a capability (or ``VLLM_COMPAT_STRICT`` refuses the build), 0
otherwise, and 2 only when there is nothing to compare: vLLM cannot be imported, or no
adapter exists for it (older than supported, a version that is not PEP 440).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from . import __version__
from .errors import VllmCompatError


def _yes_no(value: bool | None) -> str:
    return "cannot tell" if value is None else "yes" if value else "no"


def _fail(args: argparse.Namespace, exc: Exception) -> int:
    if args.json:
        print(json.dumps({"ok": False, "error": str(exc), "error_type": type(exc).__name__}))
    else:
        print(f"vllm-compat {__version__}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 2


def _detect_despite_strict(args: argparse.Namespace):
    """detect(), and where ``VLLM_COMPAT_STRICT`` refuses the build, the refusal and what
    detection finds without it (a drift report is printed whatever the policy)."""
    from .detect import detect
    from .errors import UnsupportedVllmVersionError
    from .versions import strict_mode

    try:
        return detect(), None
    except UnsupportedVllmVersionError as exc:
        if not (args.drift and strict_mode()):
            raise
        refused = exc
    saved = os.environ.pop("VLLM_COMPAT_STRICT")
    try:
        return detect(refresh=True), refused
    finally:
        os.environ["VLLM_COMPAT_STRICT"] = saved


def _hash_check(report) -> dict:
    """The engine's hasher against ours, per algorithm, and the engine's hash fingerprint
    against the nearest tested release's; the items go into ``report`` (a copy)."""
    from . import drift, hash_check

    try:
        checks = [c.as_dict() for c in hash_check.check_all()]
    except Exception as exc:  # noqa: BLE001 - the drift report is printed whatever happens
        return {"checks": [], "error": f"{type(exc).__name__}: {exc}", "fingerprint": None,
                "nearest_fingerprint": "not compared"}
    fingerprint = hash_check.fingerprint([hash_check.HashCheck(**c) for c in checks])
    snapshot = drift.load_snapshot(report.nearest_tested) if report.nearest_tested else None
    recorded = bool(snapshot and snapshot.get("hash_fingerprint"))
    report.items = list(report.items) + drift.hash_items(checks, fingerprint, snapshot,
                                                         report.nearest_tested)
    return {"checks": checks, "fingerprint": fingerprint,
            "nearest_fingerprint": "recorded" if recorded else "not recorded"}


def _doctor(args: argparse.Namespace) -> int:
    import copy

    from .detect import check_drift

    try:
        info, refused = _detect_despite_strict(args)
        report = copy.copy(check_drift()) if args.drift else None
        hashes = _hash_check(report) if report is not None else None
    except VllmCompatError as exc:
        return _fail(args, exc)
    code = 1 if (report is not None and report.affecting) or refused is not None else 0
    if args.json:
        out = {"ok": True, "vllm_compat": __version__, **info.as_dict()}
        if refused is not None:
            out["refused"] = str(refused)
        if report is not None:
            out["drift"] = report.as_dict()
            out["hash_check"] = hashes
        print(json.dumps(out, indent=2))
        return code
    print(f"vllm-compat {__version__}")
    print(f"vLLM        {info.version} (base {info.base_version}"
          f"{', pre-release' if info.is_prerelease else ''}{', local ' + info.local if info.local else ''})")
    print(f"era         {info.era}: {info.era_summary}")
    print(f"routing     {info.routing}")
    if info.newer_than_tested:
        print(f"warning     newer than the newest tested release; adapter '{info.era}' in use; "
              "VLLM_COMPAT_STRICT=1 refuses it, VLLM_COMPAT_STRICT=drift refuses it on drift "
              "that affects a capability")
    if refused is not None:
        print(f"refused     {refused}")
    print(f"runner      {info.runner}")
    for cap, why in info.drifted.items():
        print(f"drifted     {cap}: {why} (the rest of the library works)")
    print("capabilities:")
    width = max(len(k) for k in info.probes)
    for k, v in info.probes.items():
        print(f"  {k:<{width}}  {_yes_no(v)}")
    if report is not None and hashes is not None:
        for c in hashes["checks"]:
            print(f"hash scheme {_hash_line(c)}")
        if hashes.get("error"):
            print(f"hash scheme cannot tell: {hashes['error']}")
        print(f"hash fingerprint {hashes['nearest_fingerprint']} for "
              f"{report.nearest_tested or 'no tested release'}")
        print(report.format())
    return code


def _hash_line(check: dict) -> str:
    from .hash_check import HashCheck

    return HashCheck(**check).line()


def main(argv: Sequence[str] | None = None) -> int:
    """Every command under one error contract (:mod:`vllm_compat.cli_errors`): exit 2 and a
    line or two for a user's mistake, 1 for an internal failure (``--debug`` shows the
    traceback), 130 for Ctrl-C."""
    from .cli_errors import ContractParser, print_commands, run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ContractParser(prog="vllm-compat", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"vllm-compat {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a failure (also VLLM_COMPAT_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    doctor = sub.add_parser("doctor", help="installed vLLM version, era, runner, capabilities")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--drift", action="store_true",
                        help="compare the installed vLLM with the surface vllm_compat relies on "
                             "and the nearest tested release; exit 1 on drift that affects a "
                             "capability")
    doctor.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    doctor.set_defaults(func=_doctor)
    from .eagle3.cli import add_parser as add_eagle3_parser  # `vllm-compat eagle3 <step>`
    from .eagle3.cli import run_step

    add_eagle3_parser(sub)
    from .serve.cli import add_parser as add_serve_parser  # `vllm-compat serve-hidden-states`
    from .serve.cli import split_vllm_args

    add_serve_parser(sub)
    ours, tail = split_vllm_args(argv)
    args = parser.parse_args(ours)
    if args.command is None:  # `vllm-compat` alone: the commands, not argparse's names
        return print_commands(parser)
    if tail:  # `serve-hidden-states ... -- <vllm serve flags>`, as launch_vllm.py takes them
        if args.command != "serve-hidden-states":
            parser.error(f"unrecognized arguments: -- {' '.join(tail)}")
        args.vllm_args = tail
    if args.command == "eagle3":
        return run_step(args, argv)
    return run_command(args.func, args, prog=f"vllm-compat {args.command}", argv=argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
