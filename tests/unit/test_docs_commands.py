"""Every ``vllm-compat`` command printed in README.md and docs/eagle3.md runs as printed, and
bad input gets the error contract (vllm_compat.cli_errors), never a traceback.

The commands are read from the pages' fenced code blocks and run through the installed
``vllm-compat`` entry point, in a fresh directory, in the order printed. Only the
placeholders in ``SUBSTITUTIONS`` are replaced (paths the page leaves to the reader); sizes
stay as printed: the draft vocabulary is capped at the tiny target's, and the walkthrough's
chats are enough for ``--batch-size 4``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
CLI = shutil.which("vllm-compat", path=str(Path(sys.executable).parent)) or "vllm-compat"
NUM_LAYERS = 8  # EAGLE-3's default aux layers (2, L//2, L-3) are distinct from L = 8 on

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["Hello there, how are you today?", "I am fine, thank you very much.",
          "What is the capital of France?", "Paris is the capital of France.",
          "Tell me a joke about numbers 1 2 3.", "system user assistant"] * 4


def doc_commands(page: str) -> list[str]:
    """The ``vllm-compat ...`` lines of ``page``'s fenced code blocks, comments removed."""
    text = (ROOT / page).read_text()
    out = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("vllm-compat "):
                out.append(line)
    return out


def _tokenizer(path: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny Llama with its own tokenizer: what TARGET stands for in the docs."""
    from vllm_compat.testing.models import build_model

    base = tmp_path_factory.mktemp("docs-target")
    tok = _tokenizer(base / "tok", 320)
    target = Path(build_model("llama", base / "target", dtype=torch.float32, vocab_size=320,
                              hidden_size=16, num_hidden_layers=NUM_LAYERS, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=32))
    for f in tok.iterdir():  # chat_template.jinja included
        shutil.copy(f, target / f.name)
    return target


def _chats(path: Path, n: int = 12) -> Path:
    lines = [json.dumps({"messages": [{"role": "user", "content": CORPUS[i % 6]},
                                      {"role": "assistant", "content": CORPUS[(i + 1) % 6]}]})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                VLLM_COMPAT_DEBUG="", TOKENIZERS_PARALLELISM="false")


def run_cli(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def substitutions(target: Path, work: Path) -> dict[str, str]:
    """Placeholder -> value: the only words of a printed command the test replaces."""
    return {"TARGET_DIR": str(target), "TARGET": str(target), "chats.jsonl": str(_chats(work / "chats.jsonl")),
            "/models/Llama-3.1-8B-Instruct": str(target), "/tmp/hs": str(work / "hs")}


def substituted(command: str, subs: dict[str, str]) -> list[str]:
    return [subs.get(word, word) for word in shlex.split(command)][1:]


@pytest.mark.parametrize("page", ["README.md", "docs/eagle3.md"])
def test_eagle3_walkthrough_runs_as_printed(page, target, tmp_path):
    commands = [c for c in doc_commands(page) if c.startswith("vllm-compat eagle3 ")]
    steps = [shlex.split(c)[2] for c in commands]
    assert steps == ["prepare", "extract", "vocab", "train", "export", "validate"], steps
    subs = substitutions(target, tmp_path)
    for command in commands:
        r = run_cli(substituted(command, subs), tmp_path)
        assert r.returncode == 0, f"{command}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr
    assert (tmp_path / "draft" / "config.json").exists()
    assert not list(tmp_path.glob("*.partial")), "a finished step left its .partial directory"
    assert r.stdout.startswith("OK: ")


def test_other_printed_commands_follow_the_contract(target, tmp_path):
    """doctor and serve-hidden-states need vLLM: where it cannot run they say so in a line
    and exit 2 (with vLLM and a GPU they run; tests/gpu serves for real)."""
    commands = [c for c in doc_commands("README.md") if not c.startswith("vllm-compat eagle3 ")]
    assert any(c.startswith("vllm-compat serve-hidden-states ") for c in commands), commands
    commands.append("vllm-compat doctor")  # README names it inline: `vllm-compat doctor [--json]`
    from vllm_compat.eagle3.cli import vllm_can_run

    if vllm_can_run()[0]:
        pytest.skip("vLLM can run here: serve-hidden-states would serve until stopped")
    subs = substitutions(target, tmp_path)
    for command in commands:
        r = run_cli(substituted(command, subs), tmp_path, timeout=300)
        assert r.returncode == 2, f"{command}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr and "vllm" in r.stderr.lower()


# ---------------------------------------------------------------- bad input: exit 2, one line


@pytest.fixture(scope="module")
def prepared(target, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("prep")
    r = run_cli(["eagle3", "prepare", str(_chats(work / "c.jsonl", 200)), "--tokenizer", str(target),
                 "-o", "prep", "--no-progress"], work)
    assert r.returncode == 0, r.stderr
    return work / "prep"


def _refused(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("vllm-compat"), r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def _nothing_written(work: Path, name: str) -> None:
    assert not (work / name).exists() and not (work / f"{name}.partial").exists()


def test_missing_input_file(target, tmp_path):
    r = run_cli(["eagle3", "prepare", "missing.jsonl", "--tokenizer", str(target), "-o", "prep"], tmp_path)
    _refused(r, "missing.jsonl does not exist")
    _nothing_written(tmp_path, "prep")


def test_empty_input_file(target, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    r = run_cli(["eagle3", "prepare", "empty.jsonl", "--tokenizer", str(target), "-o", "prep"], tmp_path)
    _refused(r, "empty.jsonl is empty")
    _nothing_written(tmp_path, "prep")


def test_input_without_a_usable_record(target, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "no chat here"}\n{oops\n')
    r = run_cli(["eagle3", "prepare", "bad.jsonl", "--tokenizer", str(target), "-o", "prep",
                 "--no-progress"], tmp_path)
    _refused(r, "bad.jsonl: none of its records was kept")
    _nothing_written(tmp_path, "prep")


def test_unknown_tokenizer(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    r = run_cli(["eagle3", "prepare", "c.jsonl", "--tokenizer", "org/no-such-tokenizer", "-o", "prep"], tmp_path)
    _refused(r, "org/no-such-tokenizer does not exist", "local tokenizer directory")
    assert "Repo id" not in r.stderr


def test_directory_that_is_not_a_dataset(target, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    r = run_cli(["eagle3", "extract", "notes", "--target", str(target), "-o", "ds"], tmp_path)
    _refused(r, "notes is not an `eagle3 prepare` output directory")
    _nothing_written(tmp_path, "ds")
    r = run_cli(["eagle3", "train", "notes", "--target", str(target), "--vocab", "notes", "-o", "run"], tmp_path)
    _refused(r, "notes is not a hidden-state dataset")
    _nothing_written(tmp_path, "run")


def test_target_that_does_not_exist(prepared, tmp_path):
    r = run_cli(["eagle3", "extract", str(prepared), "--target", "no/such/model", "-o", "ds"], tmp_path)
    _refused(r, "no/such/model does not exist", "local model directory")
    _nothing_written(tmp_path, "ds")


@pytest.mark.parametrize("ids, words", [(["2", str(NUM_LAYERS)], f"{NUM_LAYERS} is out of range"),
                                        (["3", "1"], "distinct and increasing"),
                                        (["-1"], "must be 0 or more")])
def test_bad_layer_ids(prepared, target, tmp_path, ids, words):
    r = run_cli(["eagle3", "extract", str(prepared), "--target", str(target), "-o", "ds",
                 "--aux-layer-ids", *ids], tmp_path)
    _refused(r, words)
    _nothing_written(tmp_path, "ds")


def test_contradictory_flags_and_no_gpu(prepared, target, tmp_path):
    r = run_cli(["eagle3", "extract", str(prepared), "--target", str(target), "-o", "ds",
                 "--backend", "transformers", "--tensor-parallel-size", "2"], tmp_path)
    _refused(r, "--tensor-parallel-size configure vLLM")
    from vllm_compat.eagle3.cli import vllm_can_run

    if not vllm_can_run()[0]:
        r = run_cli(["eagle3", "extract", str(prepared), "--target", str(target), "-o", "ds",
                     "--backend", "vllm"], tmp_path)
        _refused(r, "--backend vllm needs vLLM on a GPU", "--backend transformers")
    _nothing_written(tmp_path, "ds")


@pytest.mark.parametrize("argv, words", [([], ["doctor", "eagle3", "serve-hidden-states"]),
                                         (["eagle3"], ["prepare", "extract", "vocab", "train",
                                                       "export", "validate", "evaluate"])])
def test_no_command_lists_the_commands(tmp_path, argv, words):
    r = run_cli(argv, tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for w in words:
        assert re.search(rf"^  {w} ", r.stderr, flags=re.MULTILINE), (w, r.stderr)
    assert "required" not in r.stderr and "eagle3_step" not in r.stderr


def test_internal_failure_exits_1_and_debug_shows_the_traceback(prepared, target, tmp_path):
    """A weights file that is not safetensors: the loader's own error is no user mistake we
    can name, so it is reported as internal, with the way to see more."""
    broken = tmp_path / "broken"
    shutil.copytree(target, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    args = ["eagle3", "extract", str(prepared), "--target", str(broken), "-o", "ds", "--no-progress"]
    r = run_cli(args, tmp_path)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "internal error" in lines[-2] and "--debug" in lines[-1] and "Traceback" not in r.stderr
    _nothing_written(tmp_path, "ds")
    r = run_cli([*args, "--debug"], tmp_path)
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`vllm-compat doctor --json | head -c 1`: the pipe is closed before the command
    writes; it ends quietly with the shell's code for it, 141."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte
    try:
        proc = subprocess.run([CLI, "doctor", "--json"], cwd=tmp_path, env=_env(), stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


# ---------------------------------------------------------------- Ctrl-C: exit 130, resumable


def test_ctrl_c_during_extract_says_what_is_done_and_resumes(prepared, target, tmp_path):
    args = ["eagle3", "extract", str(prepared), "--target", str(target), "-o", "ds",
            "--samples-per-shard", "2", "--dtype", "float32", "--no-progress"]
    # Ctrl-C's default action, as at a terminal: a shell without job control starts a
    # background job (`pytest ... &`, nohup) with SIGINT ignored, and the child would inherit it
    proc = subprocess.Popen([CLI, *args], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    manifest = tmp_path / "ds.partial" / "manifest.json"
    deadline = time.monotonic() + 300
    while not (manifest.exists() and json.loads(manifest.read_text())["shards"]):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted" in last and "complete shards are kept in ds.partial" in last
    assert last.endswith("resume with: vllm-compat " + shlex.join(args))
    assert not (tmp_path / "ds").exists(), "an unfinished dataset under the name asked for"
    kept = sum(s["num_samples"] for s in json.loads(manifest.read_text())["shards"])
    assert 0 < kept < 200
    r = run_cli(args, tmp_path)  # the resume command, as printed
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"] == 200
    assert (tmp_path / "ds" / "manifest.json").exists() and not (tmp_path / "ds.partial").exists()


def test_speculators_offline_entry_point_follows_the_contract(tmp_path):
    exe = Path(CLI).with_name("vllm-compat-speculators-offline")
    r = subprocess.run([str(exe), "--target-model-path", "m", "--train-data-path", "raw-data",
                        "--output-dir", "out"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "vllm-compat-speculators-offline" in line]
    assert len(errors) == 1 and "raw-data is not tokenized input" in errors[0], r.stderr
    r = subprocess.run([str(exe), "--target-model-path", "m"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=300)
    _refused(r, "--train-data-path")
