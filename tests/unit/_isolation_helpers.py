"""Functions the isolation tests run in spawned processes (importable by name, as
``run_isolated`` needs; the test modules themselves import pytest and more)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Refused(Exception):
    """An exception class of this module (its qualified name travels back)."""


def pid_and_args(*args, **kwargs):
    return os.getpid(), args, kwargs


def raise_value_error(text: str):
    raise ValueError(text)


def raise_refused(text: str):
    raise Refused(text)


def kill_self(signum: int):
    os.kill(os.getpid(), signum)
    time.sleep(60)


def exit_with(code: int):
    os._exit(code)


def big_result(n: int) -> bytes:
    return bytes(range(256)) * (n // 256)


def start_sleeper(pid_file: str, then: str = "return"):
    """Start a grandchild (as vLLM starts its engine core) and record its pid; then return,
    raise, die by SIGKILL or hang."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).write_text(str(p.pid))
    if then == "raise":
        raise RuntimeError("failed with a process running")
    if then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if then == "hang":
        time.sleep(600)
    return p.pid


def caller_of_a_hanging_call(pid_file: str) -> None:
    """The main of a process that is killed while it waits for run_isolated."""
    from vllm_compat.isolation import run_isolated

    run_isolated(start_sleeper, args=(pid_file, "hang"))


def cell(job: dict) -> dict:
    """An evaluation cell (evaluate's ``cell_fn``) for CPU tests: the numbers a run would
    report, from the prompts; ``job["engine"]["fail"]`` names a configuration that raises
    (a config vLLM refuses) and ``job["engine"]["crash"]`` one whose process dies
    (a CUDA abort); ``job["engine"]["outputs"] = "loop"``: outputs that loop. Every call is
    logged to ``job["engine"]["log"]`` with its pid."""
    engine = job["engine"]
    spec = job["speculative_config"]
    name = "baseline" if spec is None else f"{spec['method']}-k{spec['num_speculative_tokens']}"
    with open(engine["log"], "a") as f:
        f.write(json.dumps({"name": name, "pid": os.getpid(),
                            "sampling": {k: job.get(k) for k in ("temperature", "seed", "top_p")}}) + "\n")
    if name == engine.get("fail"):
        raise ValueError(f"num_speculative_tokens={spec['num_speculative_tokens']} is not possible")
    if name == engine.get("crash"):
        os.kill(os.getpid(), signal.SIGABRT)
    k = 0 if spec is None else spec["num_speculative_tokens"]
    runs, outputs = {}, {}
    for run_name, prompts in job["runs"].items():
        if engine.get("outputs") == "loop":  # the prompt's last 3 tokens over and over, as small targets do
            outs = [(p[-3:] * job["max_tokens"])[: job["max_tokens"]] for p in prompts]
        else:
            outs = [[(t + 1) % 97 for t in p[: job["max_tokens"]]] for p in prompts]
        gen = sum(map(len, outs))
        drafts = 10 * k
        accepted = 15 * k // 2
        spec_stats = None if not k else {
            "num_drafts": drafts, "num_accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / drafts, "per_position": [0.5] * k,
            "effective_acceptance_length": gen / max(gen - accepted, 1), "draft_coverage": 0.5}
        runs[run_name] = {"requests": len(prompts), "generated_tokens": gen, "wall_s": 1.0,
                          "output_tok_s": float(gen * (1 + k)), "spec": spec_stats}
        outputs[run_name] = outs
    return {"engine_start_s": 0.1, "engine": spec, "runs": runs, "outputs": outputs}


def certain_target(job: dict) -> list:
    """Evaluate's ``ceiling_fn`` for CPU tests: a target that is certain of every token of each
    sequence it is shown (top-1 logprob 0 at every position, None at the first)."""
    return [[None] + [{t: 0.0} for t in seq[1:]] for seq in job["sequences"]]


def failing_target(job: dict) -> list:
    """Evaluate's ``ceiling_fn`` whose engine refuses, as vLLM refuses more prompt logprobs
    than its ``max_logprobs``."""
    raise ValueError("Requested prompt logprobs of 20, which is greater than max allowed: 5")
