"""GPU tests: real vLLM on a CUDA device. Skipped, with the reason, anywhere else."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import tempfile
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
# Triton MoE for the tiny DeepSeek-V3: vLLM 0.20.2 otherwise picks FlashInfer's CUTLASS MoE,
# which FlashInfer 0.6.8 JIT-builds from source with ninja + nvcc on first use (the H200 run
# of 2026-11-29 was still building after 5 minutes; the test timed out). Kernel choice is
# not what these tests check.
os.environ.setdefault("VLLM_USE_FLASHINFER_MOE_FP16", "0")


def _skip_reason() -> str | None:
    for mod in ("torch", "transformers", "vllm"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    reason = _skip_reason()
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        if "gpu" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid} is in tests/gpu but not marked gpu")
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


# --------------------------------------------------------------------------- tools/run_gpu_tests.py
# VLLM_COMPAT_GPU_UNITS_OUT: at collection, each test's unit: its file, unless the module sets
# GPU_TEST_UNIT = "function" (its tests share no engine and can run apart) or
# GPU_TEST_UNIT = "param:NAME" (tests share engines only within one value of parameter NAME).
# VLLM_COMPAT_GPU_OUTCOMES: each test's outcome and duration, one JSON line as it finishes.


def pytest_collection_finish(session):
    path = os.environ.get("VLLM_COMPAT_GPU_UNITS_OUT")
    if not path:
        return
    with open(path, "a") as f:
        for item in session.items:
            f.write(json.dumps({"nodeid": item.nodeid, "unit": _unit(item)}) + "\n")


def _unit(item) -> str:
    rule = getattr(item.module, "GPU_TEST_UNIT", "module")
    file = item.nodeid.split("::")[0]
    if rule == "function":
        return item.nodeid.split("[")[0]
    if rule.startswith("param:"):
        name = rule.split(":", 1)[1]
        params = getattr(getattr(item, "callspec", None), "params", {})
        return f"{file}[{name}={params[name]}]" if name in params else file
    return file


_PHASES: dict[str, dict] = {}


def _outcome(report, row: dict) -> str:
    if report.failed:
        return "failed" if report.when == "call" else "error"
    if hasattr(report, "wasxfail") and report.when == "call":
        return "xfailed" if report.skipped else "xpassed"
    if report.skipped:
        return "skipped"
    return row["outcome"] if report.when == "teardown" else "passed"


def _relative(path: str) -> str:
    with contextlib.suppress(ValueError):  # published results name no host paths
        return os.path.relpath(path) if os.path.isabs(path) else path
    return path


def _detail(report) -> str:
    """Where a test failed and with what message (an assertion's text, an exception's), not
    only the last line of the traceback, which names the exception type alone."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return f"{_relative(crash.path)}:{crash.lineno}: {crash.message}"[:2000]
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:  # a skip: (path, line, reason)
        path, lineno, reason = report.longrepr
        return f"{_relative(path)}:{lineno}: {reason}"[:2000]
    text = report.longreprtext.strip().splitlines()
    return (text[-1] if text else "")[:2000]


def pytest_runtest_logreport(report):
    path = os.environ.get("VLLM_COMPAT_GPU_OUTCOMES")
    if not path:
        return
    row = _PHASES.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "detail": None})
    row["seconds"] += report.duration
    if row["outcome"] in ("passed",) or report.failed:
        row["outcome"] = _outcome(report, row)
    if (report.failed or report.skipped) and row["detail"] is None:
        row["detail"] = _detail(report)
    if report.when != "teardown":
        return
    _PHASES.pop(report.nodeid)
    line = json.dumps({"test": report.nodeid, "outcome": row["outcome"],
                       "seconds": round(row["seconds"], 2), "detail": row["detail"],
                       "code": os.environ.get("VLLM_COMPAT_CODE"),
                       "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # several test processes append to one file
        f.write(line + "\n")
