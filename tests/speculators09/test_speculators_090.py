"""speculators 0.9.0's own code, unmodified, in its own environment, against our server.

``prepare-data`` renders conversations through ``/v1/chat/completions/render``;
``generate-offline-data --validate-outputs`` fills ``hidden_states/hs_{i}.safetensors``
through ``/v1/completions`` and the ``.lock`` protocol; ``speculators train`` in online mode
(``--on-missing generate``) asks the server for every sample, with hs-connectors' file and
FP8 backends. The states in the files are checked against HF transformers run here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_compat.testing.chat_models import build_chat_model, conversations
from vllm_compat.testing.server import ServerProcess

from .conftest import SPECULATORS_PYTHON

HERE = Path(__file__).resolve().parent
LAYERS = [2, 4, 5, 8]  # launch_vllm.py's default for 8 layers: [2, L//2, L-3, L]
MAX_MODEL_LEN = 256


def speculators(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    """``python -m speculators <args>`` in speculators' own environment; its output."""
    assert SPECULATORS_PYTHON
    out = subprocess.run([SPECULATORS_PYTHON, *args], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, **(env or {})))
    if out.returncode != 0:
        raise AssertionError(f"{args[:3]} exited {out.returncode}:\n{out.stdout[-6000:]}\n"
                             f"{out.stderr[-6000:]}")
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")


def _server(model, tmp_path_factory, backend: str) -> ServerProcess:
    work = tmp_path_factory.mktemp(f"server-{backend}")
    return ServerProcess.hidden_states(
        model, "--backend", "transformers", "--hidden-states-backend", backend,
        "--hidden-states-path", str(work / "hidden_states"), "--max-model-len",
        str(MAX_MODEL_LEN), log_path=work / "server.log")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with _server(model, tmp_path_factory, "file") as srv:
        yield srv


@pytest.fixture(scope="module")
def server_fp8(model, tmp_path_factory):
    with _server(model, tmp_path_factory, "fp8") as srv:
        yield srv


def _server_dir(srv: ServerProcess) -> Path:
    return Path(srv.argv[srv.argv.index("--hidden-states-path") + 1])


@pytest.fixture(scope="module")
def prepared(model, server, tmp_path_factory):
    work = tmp_path_factory.mktemp("prepared")
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(12)))
    out = work / "prep"
    speculators("-m", "speculators", "prepare-data", "--model", model, "--data", str(data),
                "--output", str(out), "--render-endpoint", server.url, "--seq-length", "128",
                "--num-preprocessing-workers", "1")
    return out


def _rows(prepared: Path) -> list[dict]:
    from datasets import load_from_disk

    return list(load_from_disk(str(prepared)).with_format(None))


def _reference_states(model: str, ids: list[int]):
    """HF transformers: ``output_hidden_states[k]`` for k < L, the final norm's input for L,
    float32, then the checkpoint's bf16 (as vLLM hands the states to its connector)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    seen = []
    m.model.norm.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), output_hidden_states=True)
    L = m.config.num_hidden_layers
    rows = [seen[-1][0] if k == L else out.hidden_states[k][0] for k in LAYERS]
    return torch.stack(rows, dim=1).to(torch.bfloat16)


def test_prepare_data_renders_through_the_server(prepared, model):
    """Rows are the tokenizer's own chat-template rendering; the loss mask starts where the
    generation prompt ends (speculators derives it from two renders of ours)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = _rows(prepared)
    assert len(rows) >= 12  # one per assistant turn, repeated conversations dropped
    header = tok.convert_tokens_to_ids("<|start_header_id|>")
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        assert len(ids) == len(mask) == r["seq_len"]
        assert header in ids  # special tokens, as real chat data has
        start = mask.index(1)
        # the generation prompt (assistant header) ends right before the supervised span
        assert tok.decode(ids[:start]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert tok.decode(ids[start:]).endswith("<|eot_id|>")


def test_generate_offline_data_fills_the_dataset(prepared, server, model):
    out = prepared / "hidden_states"
    log = speculators("-m", "speculators", "generate-offline-data", "--model", model,
                      "--endpoint", server.openai_base, "--preprocessed-data", str(prepared),
                      "--validate-outputs", "--fail-on-error", "--concurrency", "8")
    rows = _rows(prepared)
    files = sorted(out.glob("hs_*.safetensors"))
    assert len(files) == len(rows), log[-3000:]
    from safetensors.torch import load_file
    import torch

    for i in (0, len(rows) // 2, len(rows) - 1):
        data = load_file(str(out / f"hs_{i}.safetensors"))
        assert set(data) == {"token_ids", "hidden_states"}
        assert data["token_ids"].dtype == torch.int64
        assert data["token_ids"].tolist() == rows[i]["input_ids"]
        assert data["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(data["hidden_states"], _reference_states(model, rows[i]["input_ids"]))
    # the client moved every file and removed every lock: nothing is left with the server
    assert list(_server_dir(server).iterdir()) == []


FP8_CHECK = r"""
import sys, torch
from pathlib import Path
from safetensors.torch import load_file
from hs_connectors import FP8Transfer
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from speculators.data_generation.offline import check_hidden_states
bf16_dir, fp8_dir, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    ref = load_file(bf16_dir / f"hs_{i}.safetensors")
    got = load_file(fp8_dir / f"hs_{i}.safetensors")
    q, s = quantize_tensor_to_fp8(ref["hidden_states"])
    assert set(got) == {"token_ids", "hidden_states", SCALES_KEY}, set(got)
    assert got["hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["hidden_states"].view(torch.uint8), q.view(torch.uint8)), i
    assert torch.equal(got[SCALES_KEY], s) and s.shape == (q.shape[0], 1, 1), i
    assert torch.equal(got["token_ids"], ref["token_ids"])
    back = FP8Transfer(fp8_dir).get_cached(i)
    check_hidden_states(back, ref["token_ids"].tolist())  # what online training checks
    assert back["hidden_states"].dtype == torch.bfloat16
print("ok", n)
"""


def test_fp8_files_are_what_hs_connectors_writes(prepared, server_fp8, model, tmp_path):
    """hs-connectors' own quantizer on the bf16 states gives our FP8 files byte for byte,
    and its FP8Transfer reads them. (``--validate-outputs`` cannot check FP8 files: torch
    has no ``aminmax`` for float8 on the CPU, so speculators' check raises on any of them,
    hs-connectors' own included.)"""
    speculators("-m", "speculators", "generate-offline-data", "--model", model,
                "--endpoint", server_fp8.openai_base, "--preprocessed-data", str(prepared),
                "--output", str(tmp_path / "fp8"), "--fail-on-error")
    n = len(_rows(prepared))
    out = speculators("-c", FP8_CHECK, str(prepared / "hidden_states"), str(tmp_path / "fp8"),
                      str(n))
    assert f"ok {n}" in out


def _train(model: str, prepared: Path, srv: ServerProcess, backend: str, work: Path) -> str:
    return speculators(
        str(HERE / "_cpu_trainer.py"), "--speculator-type", "eagle3",
        "--verifier-name-or-path", model, "--data-path", str(prepared),
        "--hidden-states-backend", backend, "--hidden-states-path", str(work / "cache"),
        "--vllm-endpoint", srv.openai_base, "--on-missing", "generate",
        "--total-seq-len", "64", "--max-steps", "3", "--epochs", "1",
        "--save-path", str(work / "draft"), "--num-workers", "0", "--optimizer", "adamw",
        "--log-freq", "1", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--train-data-ratio", "0.75", timeout=900)


@pytest.mark.parametrize("backend", ["file", "fp8"])
def test_train_online_generates_through_the_server(model, prepared, request, backend, tmp_path):
    srv = request.getfixturevalue("server" if backend == "file" else "server_fp8")
    before = srv.log().count("POST /v1/completions")
    log = _train(model, prepared, srv, backend, tmp_path)
    steps = set(re.findall(r"global_step=(\d+)", log))
    assert steps >= {"0", "1", "2"}, log[-4000:]
    assert (tmp_path / "draft" / "checkpoint_best").exists()
    assert srv.log().count("POST /v1/completions") > before  # samples came from the server
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert list(_server_dir(srv).iterdir()) == []  # each generated file read and deleted


KILLED_CLIENT = r"""
import json, sys, threading, urllib.request
url, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def one(i):
    body = json.dumps({"prompt": [(7 * i + j) % 300 + 5 for j in range(length)],
                       "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=600).read()
    print("done", i, flush=True)
for i in range(n):
    threading.Thread(target=one, args=(i,), daemon=True).start()
threading.Event().wait()
"""


def test_a_killed_client_leaves_no_lock_that_blocks_a_reader(server, model):
    """A client with 96 long prompts in flight is killed: whatever it left is never a held
    lock, a request that got no answer leaves no file (each file left is a whole one the
    server answered with), and the server answers the next request at once."""
    import fcntl

    from safetensors.torch import load_file

    d = _server_dir(server)
    before = set(d.iterdir())
    ok_before = server.log().count('/v1/completions HTTP/1.1" 200')
    p = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.url, "96",
                          str(MAX_MODEL_LEN - 1)], stdout=subprocess.DEVNULL)
    time.sleep(1.0)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(5.0)  # the server notices the disconnects and drops the rest
    answered = server.log().count('/v1/completions HTTP/1.1" 200') - ok_before
    assert answered < 96, "the client was killed after every answer: nothing was cut off"
    left = set(d.iterdir()) - before
    files = {f for f in left if f.suffix == ".safetensors"}
    assert len(files) <= answered  # unanswered requests wrote nothing
    for f in files:
        assert load_file(str(f))["hidden_states"].shape[0] == MAX_MODEL_LEN - 1  # whole files
    for f in left:
        if f.name.endswith(".lock"):
            fd = os.open(f, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a lock is held
            finally:
                os.close(fd)
    import httpx

    r = httpx.post(server.openai_base + "/completions", timeout=60,
                   json={"prompt": [1, 2, 3], "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    for f in left:
        f.unlink(missing_ok=True)
    Path(r.json()["kv_transfer_params"]["hidden_states_path"]).unlink()
