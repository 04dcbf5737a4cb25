"""bench.gpu_extraction on CPU: arguments, arithmetic, the to-disk limits, the HF (d) path,
JSON, chart.

The vLLM modes (a, b, c, e) need a GPU; everything they lean on that runs without vLLM or a
GPU is checked here (the FP8 encoding and the writers are the library's, tested in
test_fp8_states.py), and mode d runs for real on a tiny Llama.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bench import gpu_extraction as ge
from bench import (
    gpu_models,
    plot_gpu_extraction,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_ARGS = ["--num-prompts", "3", "--prompt-len", "24", "--mixed-prompts", "4",
             "--mixed-min", "5", "--mixed-max", "40", "--warmup-prompts", "1",
             "--max-model-len", "64", "--device", "cpu", "--hf-batch-tokens", "64"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-tiny")
    info = gpu_models.build("llama-tiny", d, device="cpu")
    assert not info["reused"]
    assert gpu_models.build("llama-tiny", d, device="cpu")["reused"]  # same spec: kept
    return str(d)


# ----------------------------------------------------------------------------- arguments


def test_defaults():
    a = ge.parse_args(["--model", "llama-1b"])
    assert a.modes == ["a", "b", "c", "d", "e"] and a.repeats == 3
    assert (a.num_prompts, a.prompt_len) == (128, 1024)
    assert (a.mixed_prompts, a.mixed_min, a.mixed_max) == (128, 64, 2048)
    assert a.peak_tflops == 790.0 and a.device == "cuda" and not a.enforce_eager
    assert a.max_model_len > a.mixed_max
    assert a.keep_states == "all"  # existing results and commands keep every state


def test_modes_are_parsed_and_checked(capsys):
    assert ge.parse_args(["--model", "llama-8b", "--modes", "e,a"]).modes == ["a", "e"]
    assert ge.parse_args(["--model", "deepseek-tiny", "--modes", "all"]).modes == list(ge.MODES)
    assert ge.parse_args(["--model", "llama-1b", "--modes", "b,a_sync"]).modes == ["b", "a_sync"]
    assert set(ge.RUN_ORDER) == set(ge.MODES + ge.EXTRA_MODES)
    with pytest.raises(SystemExit):
        ge.parse_args(["--model", "llama-1b", "--modes", "a,x"])
    with pytest.raises(SystemExit):
        ge.parse_args(["--model", "llama-1b", "--max-model-len", "2048"])  # 2048-token prompts
    with pytest.raises(SystemExit):
        ge.parse_args(["--model", "gpt-2"])
    capsys.readouterr()


def test_disk_dtypes_are_parsed_and_checked(capsys):
    assert ge.parse_args(["--model", "llama-1b"]).disk_dtypes == ("bf16", "fp8")
    assert ge.parse_args(["--model", "llama-1b", "--disk-dtypes", "fp8"]).disk_dtypes == ("fp8",)
    for bad in ("fp16", "", "bf16,int8"):
        with pytest.raises(SystemExit):
            ge.parse_args(["--model", "llama-1b", "--disk-dtypes", bad])


def test_workloads_are_seeded_and_in_range():
    w = ge.make_workloads(128, 1024, 128, 64, 2048, vocab=32000, seed=0)
    assert w == ge.make_workloads(128, 1024, 128, 64, 2048, vocab=32000, seed=0)
    assert len(w["fixed"]) == 128 and {len(p) for p in w["fixed"]} == {1024}
    lens = [len(p) for p in w["mixed"]]
    assert len(lens) == 128 and 64 <= min(lens) and max(lens) <= 2048 and len(set(lens)) > 100
    ids = [t for p in w["fixed"] + w["mixed"] for t in p]
    assert 3 <= min(ids) and max(ids) < 32000
    assert ge.make_workloads(2, 8, 2, 4, 9, vocab=100, seed=1) != ge.make_workloads(
        2, 8, 2, 4, 9, vocab=100, seed=0)


# ----------------------------------------------------------------------------- arithmetic


def _header_only_checkpoint(path: Path, model: torch.nn.Module) -> None:
    """config.json + a safetensors file holding only the header (count_params reads no data)."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(path / "config.json"))
    header = {n: {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [0, 0]}
              for n, p in model.named_parameters()}
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_llama_1b_shape_params_and_ceiling(tmp_path):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(gpu_models.make_config("llama-1b"))
    _header_only_checkpoint(tmp_path / "ckpt", model)
    p = gpu_models.count_params(tmp_path / "ckpt")
    emb = 32000 * 2048
    per_layer = 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192 + 2 * 2048
    assert p["total"] == 16 * per_layer + 2048 + 2 * emb == 1_104_218_112  # "1.1B"
    assert p["active"] == p["total"] and p["matmul"] == p["total"] - 2 * emb
    c = ge.ceiling(p, 790.0)
    assert c["flops_per_token"] == 2 * p["total"]
    assert c["tok_s"] == pytest.approx(790e12 / (2 * 1_104_218_112))  # ~358k tok/s
    assert 350e3 < c["tok_s"] < c["tok_s_matmul_only"] < 410e3
    # FP8: one byte per value and a float32 scale per token and layer
    assert ge.bytes_per_token(4, 2048) == {"bf16": 16384.0, "fp8": 8192.0 + 16}


def test_llama_8b_shape_is_llama_3_1_8b(tmp_path):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(gpu_models.make_config("llama-8b"))
    _header_only_checkpoint(tmp_path / "ckpt", model)
    assert gpu_models.count_params(tmp_path / "ckpt")["total"] == 8_030_261_248


def test_moe_active_params(tmp_path):
    info = gpu_models.build("deepseek-tiny", tmp_path / "ds", device="cpu")
    p = gpu_models.count_params(tmp_path / "ds")
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= 4096 and cfg["kv_lora_rank"] == 512
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    # 3 MoE layers x 8 experts x 3 matrices of 128 x 256; 2 of 8 experts active per token
    assert p["routed_experts"] == 3 * 8 * 3 * 128 * 256
    assert p["active"] == p["total"] - p["routed_experts"] * 6 // 8
    assert p["total"] >= info["params"] - 64  # + the routing-bias buffers, if saved


def _runs(v):
    return {"fixed": [{"run": 0, "tok_s": v}, {"run": 1, "tok_s": 0.9 * v}],
            "mixed": [{"run": 0, "tok_s": 0.8 * v}, {"run": 1, "tok_s": 0.85 * v}]}


def test_summary_ratios_and_targets():
    res = {"ceiling": {"tok_s": 400_000.0}, "modes": {
        "a": {"series": {"a": _runs(280_000)}},
        "b": {"series": {"b": _runs(270_000)}},
        "d": {"series": {"d": _runs(60_000)}},
        "e": {"series": {"e_returned": _runs(190_000), "e_drained": _runs(150_000)}},
        "x": {"status": "failed", "error": "boom"}}}
    s = ge.summarize(res)
    assert s["tok_s_best"]["a"] == {"fixed": 280_000, "mixed": 0.85 * 280_000}
    r = s["ratios"]
    assert r["b/a"]["fixed"] == pytest.approx(270 / 280)
    assert r["b/d"]["fixed"] == pytest.approx(4.5)
    assert r["b/e"]["fixed"] == pytest.approx(1.8)  # vs drained: the drain time counts
    assert r["b/e_returned"]["fixed"] == pytest.approx(270 / 190)
    assert s["targets"]["b/a >= 0.95"] == {"fixed": True, "mixed": True}
    assert s["targets"]["b/e >= 1.4"] == {"fixed": True, "mixed": True}
    assert s["a_over_ceiling"]["fixed"] == pytest.approx(0.7)
    assert s["c_limits"] == {}


def test_summary_reports_median_worst_spread_and_short_runs():
    def runs(v, secs):
        return {"w": [{"run": i, "tok_s": v * f, "seconds": t}
                      for i, (f, t) in enumerate(zip((1.0, 0.8, 0.9), secs))]}
    res = {"modes": {"a": {"series": {"a": runs(100.0, (12, 15, 13))}},
                     "b": {"series": {"b": runs(95.0, (12, 4, 13))}}}}
    s = ge.summarize(res)
    assert s["tok_s_spread"]["a"]["w"] == {"median": 90.0, "worst": 80.0, "spread": 0.2222,
                                           "runs": 3, "shortest_s": 12}
    assert s["ratios_median"]["b/a"]["w"] == pytest.approx(0.95)
    assert s["ratios"]["b/a"]["w"] == pytest.approx(0.95)  # best runs
    assert s["runs_under_10s"] == ["b/w"]


def test_to_disk_is_held_against_min_of_in_memory_and_the_disk_per_dtype():
    """bf16: the disk binds; FP8: in-memory extraction (b) binds, the disk being faster for
    half the bytes. Best runs, and run by run against the plain write that ran beside it."""
    res = {"modes": {
        "a": {"series": {"a": _runs(300_000)}},  # never the limit: b is
        "b": {"series": {"b": _runs(270_000)}},
        "c": {"series": {"c_bf16": _runs(95_000), "disk_bf16": _runs(100_000),
                         "c_fp8": _runs(260_000), "disk_fp8": _runs(400_000)}},
        "c_cpu": {"series": {"c_fp8_cpu": _runs(110_000)}}}}
    lim = ge.summarize(res)["c_limits"]
    bf = lim["bf16"]["fixed"]
    assert bf["binding"] == "disk" and bf["c_over_binding"] == pytest.approx(0.95)
    assert bf["in_memory_tok_s"] == 270_000 and bf["disk_tok_s"] == 100_000
    assert bf["c_over_binding_runs"] == pytest.approx([0.95, 0.95])  # run r / disk run r
    assert bf["meets_0.95"] is True
    f8 = lim["fp8"]["mixed"]
    assert f8["binding"] == "in_memory"
    assert f8["c_over_binding"] == pytest.approx(0.85 / 0.85 * 260 / 270)
    # run 0 of the mixed set: c 0.8 x 260k against min(b best 0.85 x 270k, disk 0.8 x 400k)
    assert f8["c_over_binding_runs"][0] == pytest.approx(0.8 * 260 / (0.85 * 270))
    assert f8["meets_0.95"] is True
    cpu = lim["fp8_cpu"]["fixed"]  # encoded on the CPU: held against the same limits
    assert cpu["c_over_binding"] == pytest.approx(110 / 270) and cpu["meets_0.95"] is False
    assert "fp8_cpu" in lim and set(lim) == {"bf16", "fp8", "fp8_cpu"}


def test_without_b_there_is_no_in_memory_limit():
    res = {"modes": {"c": {"series": {"c_fp8": {"w": [{"run": 0, "tok_s": 95.0}]},
                                      "disk_fp8": {"w": [{"run": 0, "tok_s": 100.0}]}}}}}
    lim = ge.summarize(res)["c_limits"]["fp8"]["w"]
    assert lim["binding"] == "disk" and lim["c_over_binding"] == pytest.approx(0.95)
    assert lim["c_over_binding_runs"] == [None]
    assert ge.summarize({"modes": {}})["ratios"]["b/a"] == {}


def test_the_plain_write_takes_the_bytes_the_c_run_wrote():
    prompts = [[1] * 100, [2] * 50]
    assert ge.plain_write_bytes({}, "fp8", prompts, 8208.0) == 150 * (8208 + 9) + 2 * 4096
    wrote = {("fp8", 150): 1_234_567, ("bf16", 150): 2_000_000, ("fp8", 99): 5}
    assert ge.plain_write_bytes(wrote, "fp8", prompts, 8208.0) == 1_234_567
    assert ge.plain_write_bytes(wrote, "bf16", prompts, 16384.0) == 2_000_000


def test_disk_write_measures_and_cleans_up(tmp_path):
    sec = ge.disk_write(tmp_path / "x.bin", 3 * (1 << 20) + 17, chunk=1 << 20)
    assert sec > 0 and not (tmp_path / "x.bin").exists()


# ----------------------------------------------------------------------------- HF (d)


def test_hf_forward_shapes_padding_and_final_layer(tiny_ckpt):
    from transformers import AutoModelForCausalLM
    ids = (2, 4, 5, 8)
    hf = ge.HFForward(tiny_ckpt, ids, "cpu", batch_tokens=64)
    prompts = ge.make_workloads(0, 1, 6, 3, 20, vocab=512, seed=3)["mixed"]
    try:
        batches = hf.batches(prompts)
        assert sorted(i for b in batches for i in b) == list(range(6))
        assert all(len(b) * max(len(prompts[i]) for i in b) <= 64 for b in batches)
        assert any(len({len(prompts[i]) for i in b}) > 1 for b in batches)  # padding happens
        got = hf.run(prompts)
    finally:
        hf.close()
    ref = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.bfloat16).eval()
    for p, g in zip(prompts, got):
        assert g.shape == (len(p), len(ids), 64) and g.dtype == torch.bfloat16
        with torch.no_grad():
            out = ref(torch.tensor([p]), output_hidden_states=True)
        for j, k in enumerate(ids[:-1]):  # right padding leaves real tokens unchanged
            torch.testing.assert_close(g[:, j], out.hidden_states[k][0], atol=2e-2, rtol=2e-2)
        # id L is the final state BEFORE the norm: norm(it) is HF's last (post-norm) entry
        normed = ref.model.norm(g[:, -1][None])[0]
        torch.testing.assert_close(normed, out.hidden_states[-1][0], atol=3e-2, rtol=3e-2)
        assert not torch.allclose(g[:, -1].float(), out.hidden_states[-1][0].float(), atol=1e-2)


# ----------------------------------------------------------------------------- the script


def test_cpu_run_of_mode_d_writes_the_json_and_the_chart(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "results"
    rc = ge.main(["--model", "llama-tiny", "--checkpoint", tiny_ckpt, "--out", str(out),
                  "--modes", "a,d", "--no-plot", *TINY_ARGS])
    assert rc == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "gpu_extraction-llama-tiny.json").read_text())
    assert res["schema"] == ge.SCHEMA and res["complete"] is True
    for key in ("env", "config", "params", "ceiling", "bytes_per_token", "workloads", "settings",
                "layer_ids", "summary", "cross_check", "elapsed_s", "targets"):
        assert key in res, key
    assert res["layer_ids"] == [2, 4, 5, 8] and res["hidden_size"] == 64
    assert res["workloads"]["fixed"] == {"prompts": 3, "tokens": 72, "min_len": 24,
                                         "max_len": 24, "seed": 0}
    assert res["modes"]["a"]["status"] == "skipped" and "CUDA" in res["modes"]["a"]["reason"]
    d = res["modes"]["d"]
    assert d["status"] == "ok" and d["startup_s"] >= 0
    for wl, spec in res["workloads"].items():
        runs = d["series"]["d"][wl]
        assert [r["run"] for r in runs] == [0, 1, 2]
        for r in runs:
            assert r["tokens"] == spec["tokens"]
            assert r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-2)
            assert r["bytes"] == spec["tokens"] * 4 * 64 * 2
    assert res["summary"]["tok_s_best"]["d"]["fixed"] == max(
        r["tok_s"] for r in d["series"]["d"]["fixed"])
    assert res["cross_check"]["finite"] == {"d": True}
    assert "llama-tiny" in printed and "d " in printed

    pytest.importorskip("matplotlib")
    png = plot_gpu_extraction.plot([out / "gpu_extraction-llama-tiny.json"], tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_gpu_extraction.main([str(out / "gpu_extraction-llama-tiny.json")]) == 0
    assert (out / "gpu_extraction-llama-tiny.png").stat().st_size > 1000
    # with to-disk series: the ratios are drawn under each workload's group
    res["modes"]["b"] = {"series": {"b": _runs(270_000)}}
    res["modes"]["c"] = {"series": {"c_bf16": _runs(95_000), "disk_bf16": _runs(100_000),
                                    "c_fp8": _runs(260_000), "disk_fp8": _runs(400_000)}}
    res["summary"] = ge.summarize(res)
    png = plot_gpu_extraction.plot([res], tmp_path / "disk.png")
    assert png.stat().st_size > 1000


def test_failures_and_the_time_budget_are_recorded(tiny_ckpt, tmp_path, monkeypatch, capsys):
    class Broken:
        def __init__(self, *a, **k):
            raise RuntimeError("no HF today")
    monkeypatch.setattr(ge, "HFForward", Broken)
    out = tmp_path / "r"
    rc = ge.main(["--model", "llama-tiny", "--checkpoint", tiny_ckpt, "--out", str(out), "--modes",
                  "d", "--no-plot", *TINY_ARGS])
    res = json.loads((out / "gpu_extraction-llama-tiny.json").read_text())
    assert res["modes"]["d"]["status"] == "failed" and "no HF today" in res["modes"]["d"]["error"]
    assert res["complete"] is True
    assert rc == 1 and "mode d FAILED: RuntimeError: no HF today" in capsys.readouterr().err

    ge.main(["--model", "llama-tiny", "--checkpoint", tiny_ckpt, "--out", str(out), "--modes",
             "d", "--no-plot", "--time-budget-s", "5", *TINY_ARGS])
    res = json.loads((out / "gpu_extraction-llama-tiny.json").read_text())
    assert res["modes"]["d"]["status"] == "skipped"
    assert res["modes"]["d"]["reason"].startswith("time budget")
    capsys.readouterr()


def test_the_time_budget_starts_once_the_checkpoint_is_built(tmp_path, capsys):
    # (d) is estimated at 90 s: with the build counted, 90.5 s would skip it
    out = tmp_path / "r"
    ge.main(["--model", "llama-tiny", "--ckpt-dir", str(tmp_path / "ckpt"),
             "--out", str(out), "--modes", "d", "--no-plot", "--time-budget-s", "90.5",
             *TINY_ARGS])
    res = json.loads((out / "gpu_extraction-llama-tiny.json").read_text())
    assert res["build"]["wall_s"] > 0.5
    assert res["modes"]["d"]["status"] == "ok", res["modes"]["d"]
    capsys.readouterr()


def test_merge_keeps_modes_of_an_earlier_run(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    path = out / "gpu_extraction-llama-tiny.json"
    ge.main(["--model", "llama-tiny", "--checkpoint", tiny_ckpt, "--out", str(out), "--modes",
             "a", "--no-plot", *TINY_ARGS])
    res = json.loads(path.read_text())
    res["modes"]["e"] = {"status": "ok", "series": {"e_drained": {"fixed": [{"tok_s": 5.0}]}}}
    path.write_text(json.dumps(res))
    ge.main(["--model", "llama-tiny", "--checkpoint", tiny_ckpt, "--out", str(out), "--modes",
             "a", "--no-plot", "--merge", *TINY_ARGS])
    merged = json.loads(path.read_text())
    assert merged["modes"]["e"]["status"] == "ok" and "merged_from" in merged
    assert merged["summary"]["tok_s_best"]["e_drained"]["fixed"] == 5.0
    capsys.readouterr()
