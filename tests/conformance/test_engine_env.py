"""The extractor's environment variables never outlive its engine (real vLLM, CPU).

The extractor builds its engine in this process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
Left set, that variable put every later ``LLM`` of the process in-process too, and engines
built after a torn-down one then failed (vLLM 0.26.0 on an H200: the memory profiler's
assertion, "CUDA graph capturing detected at an inappropriate time", a
``CUDACachingAllocator`` assertion). It is put back right after the build: vLLM reads it
only while an engine is built, which the first test checks against the installed release's
source. The compile variables a compiled engine reads while it runs are put back when it is
closed, and not before every engine holding them is (tests/gpu/test_engine_lifecycle.py
checks the closed state on a GPU); here, a build that fails (no device on this machine: vLLM
itself raises) leaves the environment exactly as it was.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest

from vllm_compat.runtime import capture_worker
from vllm_compat.runtime.extraction import engine_env

SWITCH = "VLLM_ENABLE_V1_MULTIPROCESSING"
ENGINE_VARS = (SWITCH, "VLLM_DISABLE_COMPILE_CACHE", "VLLM_USE_AOT_COMPILE", capture_worker.ENV_AUX)

# Where vLLM 0.10.2-0.33.0 reads VLLM_ENABLE_V1_MULTIPROCESSING: all while an engine is built
# (or, for the first two rows, when the variable table and usage report are defined).
BUILD_TIME = {
    "envs.py:",                                                  # the variable's definition
    "usage/usage_lib.py:",                                       # reported variables
    "envs.py:compile_factors",                                   # compile-cache key (0.16+)
    "v1/engine/llm_engine.py:LLMEngine.from_vllm_config",
    "v1/engine/llm_engine.py:LLMEngine.from_engine_args",
    "engine/arg_utils.py:EngineArgs.create_model_config",        # 0.16+: a warning
    "config/__init__.py:ModelConfig.__post_init__",              # 0.10.x
    "config/model.py:ModelConfig.__post_init__",                 # 0.11.x: a seed warning
    "config/parallel.py:ParallelConfig.__post_init__",           # sets it for external_launcher
    "executor/uniproc_executor.py:ExecutorWithExternalLauncher._init_executor",     # 0.10.x
    "v1/executor/uniproc_executor.py:ExecutorWithExternalLauncher._init_executor",
    "platforms/cpu.py:CpuPlatform.check_and_update_config",      # 0.25+
}


def _reads(root: Path) -> set[str]:
    """``file:Class.function`` of every mention of the switch in vLLM's sources."""
    found = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(errors="replace")
        if SWITCH not in text or rel.startswith("benchmarks/"):  # standalone scripts
            continue

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = (*scope, child.name)
                if (isinstance(child, ast.Constant) and child.value == SWITCH) or (
                        isinstance(child, ast.Attribute) and child.attr == SWITCH):
                    found.add(f"{rel}:{'.'.join(inner)}")
                visit(child, inner)

        visit(ast.parse(text), ())
    return found


def test_vllm_reads_the_multiprocessing_switch_only_while_building_an_engine():
    root = Path(importlib.util.find_spec("vllm").origin).parent
    reads = _reads(root)
    assert "v1/engine/llm_engine.py:LLMEngine.from_engine_args" in reads  # the scan sees them
    assert reads <= BUILD_TIME, f"read elsewhere (at run time?): {sorted(reads - BUILD_TIME)}"


def test_engine_env_sets_the_switch_for_the_build_only():
    build, run = engine_env(compiled=True, aux_ids_for_workers=(1, 3))
    assert build == {SWITCH: "0", capture_worker.ENV_AUX: "1,3"}
    assert run == {"VLLM_DISABLE_COMPILE_CACHE": "1", "VLLM_USE_AOT_COMPILE": "0"}
    assert engine_env(compiled=False) == ({SWITCH: "0"}, {})


def test_run_time_variables_stay_until_the_last_engine_holding_them_is_closed(monkeypatch):
    """Two compiled extractors open at once: closing the first must not take
    VLLM_USE_AOT_COMPILE=0 from the second (its compiled forward asserts it at every step)."""
    from vllm_compat.runtime import extraction as X

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    _, run = engine_env(compiled=True)
    X._hold_run_env(run)  # the first engine
    X._hold_run_env(run)  # the second
    X._release_run_env(run)  # the first is closed
    assert (os.environ["VLLM_USE_AOT_COMPILE"], os.environ["VLLM_DISABLE_COMPILE_CACHE"]) == ("0", "1")
    X._release_run_env(run)  # the second
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1" and "VLLM_DISABLE_COMPILE_CACHE" not in os.environ
    assert X._run_env_holds == {}


def _raised_in_vllm(info: pytest.ExceptionInfo) -> bool:
    return any("vllm" in Path(str(f.path)).parts for f in info.traceback)  # vLLM's package, not ours


def test_an_extractor_whose_build_fails_leaves_the_environment_as_it_was(model_dir, monkeypatch):
    from vllm_compat.extract import HiddenStatesExtractor

    for name in ENGINE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # the caller's own value comes back
    before = {k: os.environ.get(k) for k in ENGINE_VARS}
    with pytest.raises(Exception) as info:  # no GPU here: vLLM's own engine build raises
        HiddenStatesExtractor(model_dir, layer_ids=[1, 2], enforce_eager=False)
    assert _raised_in_vllm(info)
    assert {k: os.environ.get(k) for k in ENGINE_VARS} == before


def test_a_failure_before_vllm_is_called_leaves_the_environment_as_it_was(model_dir, monkeypatch):
    """Between setting the first variable and calling vLLM (here: making vLLM read its
    environment again fails), nothing may stay set either."""
    from vllm_compat.extract import HiddenStatesExtractor
    from vllm_compat.runtime import extraction as X

    for name in ENGINE_VARS:
        monkeypatch.delenv(name, raising=False)
    before = {k: os.environ.get(k) for k in ENGINE_VARS}
    calls = []

    def reset_fails_once() -> None:
        calls.append(dict(os.environ))
        if len(calls) == 1:
            raise RuntimeError("the environment cache could not be reset")

    monkeypatch.setattr(X, "reset_envs_cache", reset_fails_once)
    with pytest.raises(RuntimeError, match="environment cache"):
        HiddenStatesExtractor(model_dir, layer_ids=[1, 2], enforce_eager=False)
    assert calls[0][SWITCH] == "0"  # it failed with the build's variables set
    assert {k: os.environ.get(k) for k in ENGINE_VARS} == before
    assert X._run_env_holds == {}
