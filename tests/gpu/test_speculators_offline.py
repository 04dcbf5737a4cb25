"""speculators-style offline data generation on the real engine, vs the extraction API (GPU).

For a tiny random Llama and a tiny DeepSeek-V3 (MLA + MoE), built with transformers
(tests/gpu/_models.py), the speculators 0.4 flow runs with only its import changed:

* ``python -m vllm_compat.speculators.offline`` (speculators' script flags) on tokenized
  JSONL, 12 prompts of distinct lengths in one batch of 16 (>= 11: the size that
  mispaired samples in speculators 0.4.x), default layer ids in speculators' numbering (no
  flag) and in vLLM's (``--layer-convention vllm``);
* the example's speculators-shaped loop (``examples/speculators_offline.py``) on the Llama.

Every ``data_{i}.pt`` (read with ``weights_only=True``) must hold prompt i's ids, its loss
mask, and, slot by slot, the states ``HiddenStatesExtractor`` returns for the layer the slot
names (speculators id i == extractor id i + 1). Engines run one at a time and are closed.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from vllm_compat.extract import HiddenStatesExtractor
from vllm_compat.speculators import offline

from . import _models as M

pytestmark = pytest.mark.gpu

KINDS = ["llama", "deepseek_v3"]
L = 4  # _models' checkpoints have 4 decoder layers
REF_IDS = (1, 2, 3, 4)  # every id the default and legacy defaults need (DeepSeek cannot give 0)
TOL = 0.02  # two vLLM runs on the same weights and batch (M.compare "rel")
GPU_MEM = "0.05"
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "speculators_offline.py"
_REF: dict[str, list] = {}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {k: M.build(k, str(tmp_path_factory.mktemp(k))) for k in KINDS}


def reference(ckpts, kind: str) -> list:
    if kind not in _REF:
        with HiddenStatesExtractor(ckpts[kind], layer_ids=REF_IDS, max_model_len=M.MAX_LEN,
                                   gpu_memory_utilization=float(GPU_MEM), enforce_eager=True,
                                   trust_remote_code=True, **M.engine_kwargs()) as ex:
            _REF[kind] = list(ex.extract(M.prompts()))
    return _REF[kind]


def write_data(tmp_path: pathlib.Path) -> list[dict]:
    rows = []
    for i, ids in enumerate(M.prompts()):
        mask = [int((j * 7 + i) % 5 != 0) for j in range(len(ids))]
        rows.append({"input_ids": ids, "loss_mask": mask})
    path = tmp_path / "tokenized.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def check_dir(out: pathlib.Path, rows: list[dict], ref: list, slot_ids: list[int]) -> None:
    assert offline.find_last_checkpoint(out) == len(rows)
    for i, row in enumerate(rows):
        s = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert s["input_ids"].tolist() == row["input_ids"]
        assert s["loss_mask"].tolist() == row["loss_mask"]
        assert len(s["hidden_states"]) == len(slot_ids)
        r = ref[i]
        assert r.index == i and r.token_ids.tolist() == row["input_ids"]
        for slot, lid in zip(s["hidden_states"], slot_ids):
            want = r.hidden_states[:, REF_IDS.index(lid)]
            assert slot.shape == want.shape and slot.dtype == want.dtype
            err = M.compare(slot, want)
            assert err["rel"] < TOL, (i, lid, err)
    lengths = json.loads((out / "sample_lengths.json").read_text())
    assert lengths == {str(i): len(r["input_ids"]) for i, r in enumerate(rows)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("convention", ["vllm", "speculators"],
                         ids=["vllm-ids", "speculators-ids"])
def test_offline_cli_matches_extraction_api(ckpts, kind, convention, tmp_path):
    rows = write_data(tmp_path)
    out = tmp_path / "out"
    argv = ["--target-model-path", ckpts[kind],
            "--train-data-path", str(tmp_path / "tokenized.jsonl"),
            "--output-dir", str(out), "--token-freq-path", str(tmp_path / "token_freq.pt"),
            "--seq-length", str(M.MAX_LEN), "--batch-size", "16", "--tensor-parallel-size", "1",
            "--gpu-memory-utilization", GPU_MEM,
            *[f"--kv-cache-memory-bytes={v}" for v in M.engine_kwargs().values()]]
    if convention == "vllm":
        argv += ["--layer-convention", "vllm"]
    assert offline.main(argv) == 0
    cfg = json.loads((out / "data_config.json").read_text())
    assert cfg["hidden_states"]["layer_convention"] == convention
    if convention == "speculators":  # the default: [2, L//2, L-3, L-1] = [2, 2, 1, 3],
        # one state per distinct id in layer order, each the output of layer i = id i + 1
        assert cfg["hidden_states"]["layer_ids"] == [2, 2, 1, 3]
        slots = [2, 3, 4]
    else:  # EAGLE-3 default (2, L//2, L-3) + L
        assert cfg["hidden_states"]["layer_ids"] == [2, 2, 1, 4]
        slots = [2, 2, 1, 4]
    assert cfg["hidden_states"]["vllm_layer_ids"] == slots
    model_cfg = json.loads((pathlib.Path(ckpts[kind]) / "config.json").read_text())
    assert cfg["model"]["hidden_size"] == model_cfg["hidden_size"]
    check_dir(out, rows, reference(ckpts, kind), slots)


def test_example_loop_matches_extraction_api(ckpts, tmp_path):
    spec = importlib.util.spec_from_file_location("speculators_offline_example", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    rows = write_data(tmp_path)
    n = ex.generate(ckpts["llama"], rows, str(tmp_path / "out"), batch_size=16,
                    layer_ids=[1, 2, 4], layer_convention="vllm", seq_length=M.MAX_LEN,
                    gpu_memory_utilization=float(GPU_MEM), extractor_kwargs=M.engine_kwargs())
    assert n == len(rows)
    check_dir(tmp_path / "out", rows, reference(ckpts, "llama"), [1, 2, 4])
