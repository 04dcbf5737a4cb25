"""Token-by-token audit of hidden states: vllm_compat's extractor, vLLM's own extraction path
and transformers, on one checkpoint.

    python -m bench.gpu_state_audit --model kimi-tp8 --out OUT
    python -m bench.gpu_state_audit --model kimi-tp8 --out OUT --sources hf,ours,vllm

Each source runs in its own process over the same prompts (:func:`audit_prompts`: the
extraction benchmark's first prompts, which draw ids from the whole vocabulary, the same with
the tokenizer's special and reserved ids replaced, chat-shaped prompts, and filler that keeps
the engine busy for many steps as the benchmark does) and saves the states of the audited
prompts. The report, ``OUT/state_audit-<model>.json``, gives per source, prompt and layer the
relative error against the transformers fp32 reference and the other sources, and per token
where they part: the first token whose error passes ``--token-tol``, the ids there, and
whether they are special.

Sources (``--sources``):

* ``hf``: transformers in fp32 on the same weights (INT4 experts dequantized exactly);
* ``hf_bf16``: the same in bf16: how far bf16 rounding alone moves the states of this model;
* ``ours``: :class:`vllm_compat.extract.HiddenStatesExtractor`, eager;
* ``ours_lockstep``: the same with one step in flight and a blocking copy;
* ``ours_compiled``: the same compiled, with CUDA graphs;
* ``vllm``: vLLM's ``extract_hidden_states`` method with ``ExampleHiddenStatesConnector``;
* ``ours_mm`` / ``vllm_mm``: ``ours`` / ``vllm`` started the full multimodal way (tokenizer
  and image processor, remote code) instead of text-only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from . import gpu_models

SCHEMA = "vllm-compat-state-audit/1"
SOURCES = ("hf", "hf_bf16", "ours", "ours_lockstep", "ours_compiled", "vllm", "ours_mm", "vllm_mm")
DEFAULT_SOURCES = ("hf", "hf_bf16", "ours", "ours_lockstep", "vllm", "ours_mm", "vllm_mm")
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- prompts


def special_ids(ckpt: str | os.PathLike[str], vocab: int) -> list[int]:
    """The tokenizer's special and reserved ids: its added tokens, and every id above the
    regular ranks (Kimi: 163584-163839). Without tokenizer files: the top 256 ids."""
    d = Path(ckpt)
    ids: set[int] = set()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        added = json.loads(cfg.read_text()).get("added_tokens_decoder") or {}
        ids.update(int(k) for k in added)
    if ids:
        ids.update(range(min(ids), vocab))  # the reserved ids between and above them
    else:
        ids.update(range(max(0, vocab - 256), vocab))
    return sorted(i for i in ids if i < vocab)


def audit_prompts(vocab: int, specials: Sequence[int], *, filler: int = 120,
                  seed: int = 0) -> tuple[dict[str, list[int]], list[list[int]]]:
    """``(audited, filler)``: named prompts whose states are compared, and prompts run with
    them (not compared) so the engines take many steps, as in the extraction benchmark."""
    from .gpu_extraction import make_workloads

    fixed = make_workloads(128, 1024, 1, 1, 1, vocab, seed=seed)["fixed"]
    special = set(specials)
    lo_special = min(specials)
    g = torch.Generator().manual_seed(seed + 100)

    def ordinary(n: int, lo: int = 3, hi: int | None = None) -> list[int]:
        return torch.randint(lo, hi or lo_special, (n,), generator=g).tolist()

    def chat(turns: int, width: int) -> list[int]:
        # <|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...
        sp = sorted(special)
        role = sp[:8] if len(sp) >= 8 else sp
        out: list[int] = []
        for t in range(turns):
            out += [role[t % len(role)]] + ordinary(2) + [role[(t + 3) % len(role)]]
            out += ordinary(width) + [role[(t + 2) % len(role)]]
        return out

    remapped = [t - lo_special + 40_000 if t in special else t for t in fixed[0]]
    one = ordinary(128)
    one[64] = sorted(special)[len(special) // 2]
    dense = ordinary(256)
    for j in range(0, 256, 8):
        dense[j] = sorted(special)[(j // 8) % len(special)]
    audited = {
        "bench-0": fixed[0], "bench-0-no-special": remapped,
        "bench-1": fixed[1], "bench-2": fixed[2],
        "low-ids": ordinary(1024, 3, 32_000), "high-ids": ordinary(1024, 32_000),
        "chat": chat(12, 60), "special-every-8th": dense, "one-special-at-64": one,
    }
    return audited, [list(p) for p in fixed[3:3 + filler]]


def special_positions(ids: Sequence[int], specials: set[int]) -> list[int]:
    return [j for j, t in enumerate(ids) if t in specials]


# --------------------------------------------------------------------------- sources


def _engine_kwargs(mm: bool) -> dict[str, Any]:
    kw: dict[str, Any] = dict(max_model_len=4096, dtype="bfloat16", seed=0,
                              gpu_memory_utilization=0.5)
    if mm:  # tokenizer and image processor at start, not text-only
        kw.update(language_model_only=False, trust_remote_code=True, skip_tokenizer_init=False)
    return kw


def run_ours(ckpt: str, prompts: list[list[int]], n_keep: int, ids: tuple[int, ...],
             variant: str) -> tuple[list[torch.Tensor], dict[str, Any]]:
    from vllm_compat.extract import HiddenStatesExtractor

    kw = _engine_kwargs(variant == "ours_mm")
    kw.update(enforce_eager=variant != "ours_compiled")
    if variant == "ours_lockstep":
        kw.update(launch_ahead=False, overlap_copy=False)
    with HiddenStatesExtractor(ckpt, layer_ids=ids, **kw) as ex:
        kept = [s.hidden_states.clone() for s in ex.extract(prompts) if s.index < n_keep]
        info = dict(ex.info)
    return kept, info


def run_vllm(ckpt: str, prompts: list[list[int]], n_keep: int, ids: tuple[int, ...],
             variant: str, scratch: Path) -> tuple[list[torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_compat.runtime.extraction import wait_hidden_states_saved

    store = scratch / "connector"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    # text-only as the benchmark's (e) runs it, unless the multimodal start is asked for
    kw: dict[str, Any] = dict(model=ckpt, enable_prefix_caching=False, enforce_eager=True,
                              skip_tokenizer_init=True, language_model_only=True)
    kw.update(_engine_kwargs(variant == "vllm_mm"))
    kw.update(speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(ids)}}},
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(store)}})
    llm = LLM(**kw)
    try:
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        wait_hidden_states_saved([p for p in paths[:n_keep]], llm)
        pos = [sorted(ids).index(k) for k in ids]
        kept = []
        for p, ids_ in zip(paths[:n_keep], prompts):
            f = load_file(p)
            if f["token_ids"].tolist()[: len(ids_)] != ids_:
                raise RuntimeError(f"{p}: token_ids differ from the prompt")
            kept.append(f["hidden_states"][: len(ids_)][:, pos].clone())
        info = {"engine": type(llm.llm_engine).__name__, "files": len(paths)}
    finally:
        from vllm_compat.runtime.llm import close_llm
        close_llm(llm)
        shutil.rmtree(store, ignore_errors=True)
    return kept, info


def run_hf(ckpt: str, prompts: list[list[int]], ids: tuple[int, ...],
           dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """transformers fp32, one prompt at a time (no padding); id k = input of layer k, L = the
    final pre-norm state."""
    from vllm_compat.target import read_target

    target = read_target(ckpt)
    if target.is_multimodal_wrapper:
        from vllm_compat.testing.kimi_k25 import kimi_k25_text_model_for_reference
        model = kimi_k25_text_model_for_reference(ckpt, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    L = model.config.num_hidden_layers
    out = []
    with torch.no_grad():
        for p in prompts:
            cap: dict[str, torch.Tensor] = {}
            h = model.model.norm.register_forward_pre_hook(lambda m, a: cap.update(x=a[0]))
            try:
                hs = model(torch.tensor([p], device=device), output_hidden_states=True,
                           logits_to_keep=1).hidden_states
            finally:
                h.remove()
            out.append(torch.stack([hs[k][0] if k < L else cap["x"][0] for k in ids],
                                   dim=1).float().cpu())
    return out, {"model": type(model).__name__, "dtype": str(dtype).removeprefix("torch.")}


def run_source(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.prompts_file).read_text())
    audited = list(spec["audited"].values())
    ids = tuple(spec["layer_ids"])
    t0 = time.perf_counter()
    if args.source.startswith("hf"):
        dtype = torch.bfloat16 if args.source == "hf_bf16" else torch.float32
        states, info = run_hf(spec["checkpoint"], audited, ids, dtype)
    else:
        prompts = audited + spec["filler"]
        run = run_vllm if args.source.startswith("vllm") else run_ours
        extra = (Path(args.scratch),) if run is run_vllm else ()
        states, info = run(spec["checkpoint"], prompts, len(audited), ids, args.source, *extra)
    info = json.loads(json.dumps(info, default=str))
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    torch.save({"states": states, "info": info}, Path(args.scratch) / f"{args.source}.pt")
    return 0


# --------------------------------------------------------------------------- comparison


def token_rel(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token and layer ``|got - ref| / |ref|``: ``[tokens, layers]``."""
    g, r = got.float(), ref.float()
    return (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)


def compare_pair(got: torch.Tensor, ref: torch.Tensor, ids: Sequence[int],
                 prompt: Sequence[int], specials: set[int], token_tol: float) -> dict[str, Any]:
    """Per layer: relative error of the whole prompt; per token: where they part."""
    g, r = got.float(), ref.float()
    per_layer = {str(k): float((g[:, j] - r[:, j]).norm() / r[:, j].norm().clamp_min(1e-12))
                 for j, k in enumerate(ids)}
    tr = token_rel(g, r)
    first = tr[:, 0]  # the shallowest layer shows where a difference enters
    bad = (first > token_tol).nonzero().flatten().tolist()
    sp = special_positions(prompt, specials)
    return {
        "rel": per_layer,
        "tokens_over_tol": len(bad),
        "first_over_tol": bad[0] if bad else None,
        "over_tol_ids": [int(prompt[j]) for j in bad[:16]],
        "over_tol_special": sum(int(prompt[j]) in specials for j in bad),
        "first_special": sp[0] if sp else None,
        "worst_token": int(first.argmax()), "worst_token_rel": float(first.max()),
        "median_token_rel": float(first.median()),
        # every layer: how the difference is spread over the tokens
        "median_token_rel_per_layer": {str(k): float(tr[:, j].median()) for j, k in enumerate(ids)},
        "frac_tokens_over_tol_per_layer": {str(k): float((tr[:, j] > token_tol).float().mean())
                                           for j, k in enumerate(ids)},
    }


def compare(spec: dict[str, Any], states: dict[str, list[torch.Tensor]],
            token_tol: float) -> dict[str, Any]:
    names = list(spec["audited"])
    ids = spec["layer_ids"]
    specials = set(spec["specials"])
    pairs = [(s, "hf") for s in states if s != "hf" and "hf" in states]
    pairs += [(a, b) for a in states for b in states
              if a < b and not {a, b} & {"hf", "hf_bf16"}]
    pairs += [(s, "hf_bf16") for s in states if s not in ("hf", "hf_bf16") and "hf_bf16" in states]
    out: dict[str, Any] = {}
    for a, b in pairs:
        out[f"{a} vs {b}"] = {
            n: compare_pair(states[a][i], states[b][i], ids, spec["audited"][n], specials,
                            token_tol)
            for i, n in enumerate(names)}
    return out


def summary(pairs: dict[str, Any], ids: Sequence[int]) -> list[str]:
    """One line per pair and prompt: the relative error at each layer."""
    lines = []
    for pair, per_prompt in pairs.items():
        for name, c in per_prompt.items():
            rel = " ".join(f"{c['rel'][str(k)]:.4f}" for k in ids)
            lines.append(f"{pair:28s} {name:20s} rel[{','.join(map(str, ids))}] = {rel}  "
                         f"tokens>tol {c['tokens_over_tol']} (special {c['over_tol_special']}), "
                         f"first {c['first_over_tol']}, first special {c['first_special']}")
    return lines


# --------------------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(gpu_models.SPECS), default="kimi-tp8")
    ap.add_argument("--checkpoint", help="use this checkpoint instead of building --model's")
    ap.add_argument("--out", default="/tmp/vllm-compat-bench/results")
    ap.add_argument("--scratch", help="states of each source (default: <out>/audit-<model>)")
    ap.add_argument("--sources", default=",".join(DEFAULT_SOURCES))
    ap.add_argument("--layer-ids", default="1,2,L/2,L", help="ids; L = the final state")
    ap.add_argument("--filler", type=int, default=120, help="prompts run but not compared")
    ap.add_argument("--token-tol", type=float, default=0.05)
    ap.add_argument("--source-timeout-s", type=float, default=600.0)
    ap.add_argument("--reuse", action="store_true",
                    help="compare with the states earlier runs left in --scratch too")
    ap.add_argument("--source", help=argparse.SUPPRESS)  # one source, in its own process
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    bad = [s for s in a.sources.split(",") if s not in SOURCES]
    if bad:
        ap.error(f"unknown source(s) {bad}; choose from {','.join(SOURCES)}")
    return a


def layer_ids(text: str, L: int) -> tuple[int, ...]:
    """``"1,2,L/2,L-3,L"`` -> ids, ``L`` being the number of layers (the final state)."""
    out = []
    for x in (t.strip() for t in text.split(",")):
        if x.startswith("L"):
            rest = x[1:]
            k = L if not rest else L // int(rest[1:]) if rest[0] == "/" else L + int(rest)
        else:
            k = int(x)
        if not 0 <= k <= L:
            raise ValueError(f"layer id {x} = {k} is outside 0..{L}")
        out.append(k)
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    scratch = Path(a.scratch or Path(a.out) / f"audit-{a.model}")
    if a.source:
        a.scratch = str(scratch)
        return run_source(a)
    from vllm_compat.target import read_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    ckpt = a.checkpoint or f"/tmp/vllm-compat-bench/{a.model}"
    build = None if a.checkpoint else gpu_models.build(a.model, ckpt)
    target = read_target(ckpt)
    vocab = int(target.text_config.get("vocab_size") or target.config["vocab_size"])
    specials = special_ids(ckpt, vocab)
    audited, filler = audit_prompts(vocab, specials, filler=a.filler)
    spec = {"checkpoint": ckpt, "layer_ids": list(layer_ids(a.layer_ids,
                                                            target.num_hidden_layers)),
            "specials": specials, "audited": audited, "filler": filler}
    prompts_file = scratch / "prompts.json"
    prompts_file.write_text(json.dumps(spec))
    from vllm_compat.testing.provenance import code_id, versions

    report: dict[str, Any] = {"schema": SCHEMA, "model": a.model, "checkpoint": ckpt,
                              "code": code_id(ROOT), "versions": versions(),
                              "date": time.strftime("%Y-%m-%d"),
                              "command": "python -m bench.gpu_state_audit " + " ".join(
                                  sys.argv[1:] if argv is None else argv),
                              "build": build, "layer_ids": spec["layer_ids"],
                              "token_tol": a.token_tol, "sources": {},
                              "prompts": {n: {"len": len(p), "special_positions":
                                              special_positions(p, set(specials))[:32]}
                                          for n, p in audited.items()}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    states: dict[str, list[torch.Tensor]] = {}
    for src in SOURCES if a.reuse else ():
        f = scratch / f"{src}.pt"
        if f.exists() and src not in a.sources.split(","):
            saved = torch.load(f)
            states[src] = saved["states"]
            report["sources"][src] = {"rc": 0, "reused": True, "info": saved["info"]}
    for src in a.sources.split(","):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "bench.gpu_state_audit", "--model", a.model,
               "--scratch", str(scratch), "--source", src, "--prompts-file", str(prompts_file)]
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, timeout=a.source_timeout_s,
                               capture_output=True, text=True)
            rc, tail = r.returncode, (r.stdout + r.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            rc, tail = 124, "timed out"
        rec: dict[str, Any] = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
        if rc == 0:
            saved = torch.load(scratch / f"{src}.pt")
            states[src] = saved["states"]
            rec["info"] = saved["info"]
        else:
            rec["error"] = tail
        report["sources"][src] = rec
        print(f"{src}: rc={rc} in {rec['wall_s']} s", flush=True)
        if rc != 0:
            print(tail, flush=True)
    report["pairs"] = compare(spec, states, a.token_tol)
    lines = summary(report["pairs"], spec["layer_ids"])
    report["summary"] = lines
    path = out / f"state_audit-{a.model}.json"
    path.write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
