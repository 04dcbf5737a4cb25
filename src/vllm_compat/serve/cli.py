"""``vllm-compat serve-hidden-states MODEL``: what speculators' ``launch_vllm.py`` starts, served
from the in-process extractor.

speculators 0.5-0.9 start vLLM for hidden states with ``scripts/launch_vllm.py MODEL
[--hidden-states-backend file|fp8] [--hidden-states-path DIR] [--target-layer-ids ...]
[--include-last-layer] -- <vllm serve flags>``. This command takes the same flags (and the
``vllm serve`` flags that apply, before or after ``--``) and answers the same API, so a fork
replaces that one command and nothing else.

Layer ids are speculators' numbering for these releases, which is vLLM's: id ``k`` is the
state entering decoder layer ``k``, ``L`` (``num_hidden_layers``) the final one. Default
``[2, L//2, L-3, L]``; with ``--target-layer-ids`` the list given, with ``L`` appended unless
``--no-include-last-layer`` (as ``launch_vllm.py`` builds it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

from ..cli_args import json_object

__all__ = ["add_parser", "build_service", "layer_ids_like_launch_vllm", "main", "run",
           "split_vllm_args"]

# launch_vllm.py's backends (hs-connectors 0.9 registry): mooncake needs a Mooncake store
BACKENDS = {"file": "model", "fp8": "fp8"}
# the extractor's backends that take prompts while running ("native" runs LLM.generate)
EXTRACTOR_BACKENDS = ("auto", "aux", "hooks", "transformers")


def layer_ids_like_launch_vllm(num_layers: int, target_layer_ids: Sequence[int] | None,
                               include_last_layer: bool = True) -> list[int]:
    """The ids ``launch_vllm.py`` (speculators 0.9) puts in ``eagle_aux_hidden_state_layer_ids``."""
    L = num_layers
    if target_layer_ids:
        ids = list(target_layer_ids)
        if include_last_layer and L not in ids:
            ids.append(L)
    else:
        ids = [2, L // 2, L - 3, L]
    if min(ids) < 0 or max(ids) > L or len(set(ids)) != len(ids):
        raise ValueError(f"Invalid target layer ids {ids}; ids must be distinct and within "
                         f"[0, {L}].")
    return ids


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve-hidden-states", help="vLLM's OpenAI API for speculators 0.5-0.9 hidden states",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="local checkpoint directory or Hugging Face model id")
    g = p.add_argument_group("speculators launch_vllm.py flags")
    g.add_argument("--hidden-states-backend", choices=[*BACKENDS, "mooncake"], default="file",
                   help="file: vLLM's ExampleHiddenStatesConnector files; fp8: hs-connectors' "
                        "FP8HiddenStatesConnector files (default: file)")
    g.add_argument("--hidden-states-path", default="/tmp/hidden_states",
                   help="directory the files are written to (default: /tmp/hidden_states)")
    g.add_argument("--target-layer-ids", type=int, nargs="+",
                   help="layer ids (default: [2, L//2, L-3] and L)")
    g.add_argument("--include-last-layer", action=argparse.BooleanOptionalAction, default=True,
                   help="append L to --target-layer-ids (default: on)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run code the checkpoint ships (its model, tokenizer)")
    add_vllm_flags(p.add_argument_group("vllm serve flags (also accepted after --)"))
    g = p.add_argument_group("extraction and serving")
    g.add_argument("--backend", choices=EXTRACTOR_BACKENDS, default="auto",
                   help="extractor backend (default auto: vLLM's aux path, compiled); "
                        "transformers: no vLLM, runs on the CPU")
    g.add_argument("--device", default="cpu", help="--backend transformers: the torch device")
    g.add_argument("--num-writer-threads", type=int, default=8)
    g.add_argument("--max-pending-requests", type=int, default=256,
                   help="requests held between admission and their file being written")
    g.add_argument("--max-pending-tokens", type=int,
                   help="prompt tokens held likewise (default: max(max_model_len, 65536))")
    g.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="requests waiting for admission before the server answers 503")
    g.add_argument("--engine-kwargs", type=json_object, help="JSON of more vllm.LLM keywords")
    g.add_argument("--log-level", default="info")
    g.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    p.set_defaults(func=run, vllm_args=[])  # vllm serve flags after --: see split_vllm_args
    return p


def add_vllm_flags(g: Any) -> None:
    g.add_argument("--host", default="0.0.0.0", help="default: every interface, as vllm serve")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+",
                   help="names the API answers to (default: MODEL as given)")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--dtype")
    g.add_argument("--chat-template", help="template text or file (default: the tokenizer's)")


def _vllm_tail(args: argparse.Namespace, tail: list[str]) -> None:
    """Flags after ``--`` (launch_vllm.py hands those to ``vllm serve``)."""
    if not tail:
        return
    parser = argparse.ArgumentParser(prog="vllm-compat serve-hidden-states ... --",
                                     add_help=False)
    add_vllm_flags(parser)
    known, unknown = parser.parse_known_args(tail)
    if unknown:
        raise ValueError(f"vllm serve flags not supported here: {' '.join(unknown)} (supported: "
                         "--host --port --served-model-name --max-model-len "
                         "--tensor-parallel-size --gpu-memory-utilization "
                         "--max-num-batched-tokens --max-num-seqs --enforce-eager --dtype "
                         "--chat-template; more engine keywords go in --engine-kwargs)")
    defaults = vars(parser.parse_args([]))
    for k, v in vars(known).items():
        if v != defaults[k]:
            setattr(args, k, v)


def _local_model(model: str) -> str:
    if os.path.isdir(model):
        return model
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:  # a path, not ORG/NAME
        what = "is a file" if os.path.exists(model) else "does not exist"
        raise FileNotFoundError(f"{model} {what}: MODEL is a local checkpoint directory or a "
                                "Hugging Face model id (ORG/NAME)")
    from huggingface_hub import snapshot_download  # comes with transformers

    try:
        return snapshot_download(model)
    except Exception as exc:  # offline, a typo, a gated repository
        raise FileNotFoundError(f"{model} is not a local directory and could not be fetched "
                                f"from the Hugging Face Hub: {exc}") from exc


def build_service(args: argparse.Namespace) -> Any:
    """The extractor, files and service the command serves (the extractor is started)."""
    from ..extract import HiddenStatesExtractor
    from ..target import read_target
    from .chat import ChatRenderer
    from .hs_files import HiddenStatesFiles
    from .service import HiddenStatesService

    if args.hidden_states_backend not in BACKENDS:
        raise ValueError(f"--hidden-states-backend {args.hidden_states_backend} is not supported "
                         f"(choose {' or '.join(BACKENDS)}): the Mooncake store is written by "
                         "hs-connectors' own connector inside vLLM")
    path = _local_model(args.model)
    target = read_target(path)
    ids = layer_ids_like_launch_vllm(target.num_hidden_layers, args.target_layer_ids,
                                     args.include_last_layer)
    kw: dict[str, Any] = {}
    if args.backend == "transformers":
        kw["device"] = args.device
    else:
        kw.update(tensor_parallel_size=args.tensor_parallel_size,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager)
        if args.max_num_seqs:
            kw["max_num_seqs"] = args.max_num_seqs
        if args.dtype:
            kw["dtype"] = args.dtype
        if args.engine_kwargs:
            kw.update(args.engine_kwargs)
    if args.trust_remote_code:
        kw["trust_remote_code"] = True
    extractor = HiddenStatesExtractor(target, layer_ids=ids, backend=args.backend,
                                      max_model_len=args.max_model_len, **kw)
    try:
        renderer = None
        if any(os.path.isfile(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            renderer = ChatRenderer(path, chat_template=args.chat_template,
                                    trust_remote_code=args.trust_remote_code)
        files = HiddenStatesFiles(args.hidden_states_path, BACKENDS[args.hidden_states_backend],
                                  num_threads=args.num_writer_threads)
        return HiddenStatesService(
            extractor, files, served_names=args.served_model_name or [args.model],
            model_path=path, renderer=renderer, max_pending_requests=args.max_pending_requests,
            max_pending_tokens=args.max_pending_tokens,
            max_waiting_requests=args.max_waiting_requests)
    except BaseException:
        extractor.close()
        raise


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted. Errors follow :mod:`vllm_compat.cli_errors` (the command
    line runs this under it): a user mistake (a bad flag value, a missing checkpoint, an
    unsupported choice) is one line on stderr and exit code 2; ``--debug`` (or
    ``VLLM_COMPAT_DEBUG=1``) shows the traceback instead."""
    _vllm_tail(args, args.vllm_args)
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    service = build_service(args)
    log = logging.getLogger("vllm_compat.serve")
    log.info("serving %s as %s: layers %s, backend %s, %s files in %s, max_model_len %d",
             service.model_path, service.served_names, list(service.extractor.layer_ids),
             service.extractor.backend, args.hidden_states_backend, args.hidden_states_path,
             service.max_model_len)
    uvicorn.run(create_app(service), host=args.host, port=args.port,
                log_level=args.log_level.lower(), timeout_graceful_shutdown=30)
    return 0


def split_vllm_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(ours, vllm's)``: launch_vllm.py hands everything after ``--`` to ``vllm serve``."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vllm_compat.serve.cli MODEL ...`` (the same as ``vllm-compat
    serve-hidden-states MODEL ...``)."""
    from ..cli_errors import ContractParser, run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ContractParser(prog="vllm-compat")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ours, tail = split_vllm_args(argv)
    args = parser.parse_args(["serve-hidden-states", *ours])
    args.vllm_args = tail
    return run_command(args.func, args, prog="vllm-compat serve-hidden-states",
                       argv=["serve-hidden-states", *argv])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
