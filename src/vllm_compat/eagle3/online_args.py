"""``vllm-compat eagle3 train --online``: its configuration and arguments.

:class:`OnlineConfig` is what :func:`vllm_compat.eagle3.online.train_online` takes;
:func:`add_online_arguments` adds its options to the ``train`` subparser, and
:func:`online_config` checks them and builds it (ValueError naming the options that do not go
together). With ``--online`` the positional ``dataset`` is a ``prepare`` output directory:
the states are extracted while training. No torch here: the CLI parser imports it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

PLACEMENTS = ("colocated", "split", "replicas")
BACKENDS = ("vllm", "transformers")
STATES_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


@dataclass
class OnlineConfig:
    """How the states are produced while training (the CLI's ``--online`` arguments)."""

    backend: str = "vllm"  # "vllm", or "transformers" (the target in HF transformers)
    aux_layer_ids: tuple[int, ...] | None = None  # None: EAGLE-3's (2, L//2, L-3)
    # the dtype the shards would store: states are cast (or FP8 encoded and decoded) to it
    states_dtype: str = "bfloat16"
    # ready batches the extractor may run ahead of the trainer (replicas: units in flight)
    queue_depth: int = 4
    unit_steps: int = 8  # steps extracted together (one idle-to-idle extract call)
    cache: str | None = None  # keep the states as shards here, read what is there
    samples_per_unit: int | None = None  # cache: records per unit (default 4 shards)
    samples_per_shard: int = 256  # cache: samples per shard
    placement: str = "colocated"
    engine_devices: str | None = None  # split: CUDA devices of the engine, e.g. "1" or "1,2"
    # replicas (many hosts): engine replicas as Ray actors, per trainer process
    engine_replicas: int | None = None
    ray_address: str | None = None  # ray.init's ("auto": the running cluster)
    kv_cache_memory_bytes: int | None = None  # co-located vLLM: the KV-cache budget
    gpu_memory_utilization: float | None = None  # vLLM's, when no KV budget is given
    # co-located: the memory both may use (None: the CUDA device's total; on the CPU unchecked)
    memory_limit_bytes: int | None = None
    extractor_kwargs: dict[str, Any] = field(default_factory=dict)  # more HiddenStatesExtractor keywords
    # co-located on a GPU: the draft's training step on a CUDA stream of its own. The in-process
    # engine and the trainer otherwise queue their kernels on one default stream, one after
    # the other, so neither can run while the other's kernels are queued
    trainer_stream: bool = False
    # co-located: the engine in a spawned process of its own on the trainer's device (as the
    # split placement runs it), so its Python does not take turns with the trainer's for one
    # interpreter lock; the memory plan is the same
    engine_process: bool = False

    def check(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.states_dtype not in STATES_DTYPES:
            raise ValueError(f"states_dtype must be one of {STATES_DTYPES}, got {self.states_dtype!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {self.queue_depth}")
        if self.unit_steps < 1:
            raise ValueError(f"unit_steps must be >= 1, got {self.unit_steps}")
        if self.placement == "replicas":
            if self.engine_replicas is None or self.engine_replicas < 1:
                raise ValueError("the replicas placement needs engine_replicas >= 1 "
                                 f"(CLI --engine-replicas N), got {self.engine_replicas}")
            if self.engine_devices:
                raise ValueError("--engine-devices (split, one host) and --engine-replicas "
                                 "(Ray replicas): choose one placement")
            if self.cache:
                raise ValueError("--cache is not available with --engine-replicas: extract the "
                                 "cache with eagle3 extract --replicas, or train without a cache")
            if not ray_available():
                raise ValueError("--engine-replicas runs the engines as Ray actors and needs Ray: "
                                 "pip install 'vllm-compat[ray]'")
        elif self.engine_replicas is not None or self.ray_address is not None:
            raise ValueError("engine_replicas / ray_address (CLI --engine-replicas, --ray-address) "
                             "go with the replicas placement")
        if self.trainer_stream and self.placement != "colocated":
            raise ValueError("trainer_stream (CLI --trainer-stream) is for the co-located placement: "
                             "the split and replicas placements run the engine in other processes")
        if self.engine_process and (self.placement != "colocated" or self.trainer_stream):
            raise ValueError("engine_process (CLI --engine-process) is for the co-located "
                             "placement, without --trainer-stream: the engine gets a process of "
                             "its own on the training GPU")
        if self.placement == "split" and not self.engine_devices and self.backend == "vllm":
            raise ValueError("the split placement runs the engine on its own GPUs: name them "
                             "(engine_devices='1', CLI --engine-devices 1)")

    @property
    def torch_states_dtype(self) -> Any:
        import torch

        return getattr(torch, self.states_dtype)

    @property
    def unit_size(self) -> int:
        return self.samples_per_unit or 4 * self.samples_per_shard



def ray_available() -> bool:
    """Whether ``import ray`` can work (Ray is optional: the ``ray`` extra)."""
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # a module without a spec (sys.modules["ray"] = None)
        return False


# options that mean nothing without --online (their defaults, to tell "given" apart)
_ONLINE_ONLY = ("backend", "aux_layer_ids", "states_dtype", "queue_depth", "unit_steps", "cache",
                "samples_per_unit", "samples_per_shard", "engine_devices", "engine_replicas",
                "ray_address", "kv_cache_memory_bytes",
                "gpu_memory_utilization", "max_num_batched_tokens", "tensor_parallel_size",
                "engine_kwargs", "trust_remote_code", "trainer_stream", "engine_process")


def add_online_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "online (--online: DATASET is a prepare output; the states are extracted while training "
        "and not written to disk)")
    g.add_argument("--online", action="store_true",
                   help="extract the target's hidden states while training instead of reading shards")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="vllm (default), or transformers: the target in HF transformers (CPU runs)")
    g.add_argument("--aux-layer-ids", type=int, nargs="+", help="default: EAGLE-3's (2, L//2, L-3)")
    g.add_argument("--states-dtype", choices=STATES_DTYPES, default=None,
                   help="the dtype shards would store (default bfloat16); float8_e4m3fn: FP8 with "
                        "a scale per token and layer, encoded and decoded as shards are")
    g.add_argument("--queue-depth", type=int, default=None,
                   help="batches the extractor may run ahead of the trainer (default 4); with "
                        "--engine-replicas: online units in flight per trainer")
    g.add_argument("--unit-steps", type=int, default=None,
                   help="training steps whose prompts are extracted together (default 8)")
    g.add_argument("--cache", metavar="DIR",
                   help="keep the extracted states here as shards (the work-unit format of "
                        "eagle3 extract --replicas) and read what is already there")
    g.add_argument("--samples-per-unit", type=int, help="--cache: records per unit (default 4 shards)")
    g.add_argument("--samples-per-shard", type=int, default=None, help="--cache: samples per shard (default 256)")
    g.add_argument("--engine-devices", metavar="IDS",
                   help="split placement: the engine in its own process on these GPUs (e.g. 1 or "
                        "1,2,3,4), the trainer on GPU 0; default: co-located on the training GPU")
    g.add_argument("--engine-replicas", type=int, metavar="N",
                   help="many hosts: N engine replicas as Ray actors (placed by Ray, GPUs per "
                        "replica = --tensor-parallel-size), feeding this trainer (each torchrun "
                        "rank starts its own N) through Ray's object store; needs Ray "
                        "(pip install 'vllm-compat[ray]')")
    g.add_argument("--ray-address", help="--engine-replicas: ray.init's address ('auto': the "
                                         "running cluster; default: start one here)")
    g.add_argument("--kv-cache-memory-bytes", type=int,
                   help="the engine's KV-cache budget (co-located default: 10%% of the GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, help="vLLM's, for the split placement")
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--tensor-parallel-size", type=int, default=None)
    g.add_argument("--engine-kwargs", help="JSON of more vllm.LLM keywords")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let the engine run the code the checkpoint ships (Kimi-K2.5)")
    g.add_argument("--trainer-stream", action="store_true",
                   help="co-located on a GPU: the draft's training step on a CUDA stream of its own, "
                        "beside the engine's")
    g.add_argument("--engine-process", action="store_true",
                   help="co-located: the engine in a process of its own on the training GPU, so "
                        "its Python and the trainer's do not take turns in one interpreter")


def online_config(a: argparse.Namespace) -> OnlineConfig | None:
    """None without ``--online``; else the checked configuration. Online options given
    without ``--online`` are an error (they would be ignored)."""
    if not a.online:
        given = [n for n in _ONLINE_ONLY if getattr(a, n, None) not in (None, False)]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise ValueError(f"{flags}: only with --online (states extracted while training)")
        return None
    backend = a.backend or "vllm"
    extractor_kwargs: dict[str, Any] = {}
    if backend == "vllm":
        if a.max_num_batched_tokens is not None:
            extractor_kwargs["max_num_batched_tokens"] = a.max_num_batched_tokens
        if a.tensor_parallel_size is not None:
            extractor_kwargs["tensor_parallel_size"] = a.tensor_parallel_size
        if a.trust_remote_code:
            extractor_kwargs["trust_remote_code"] = True
        if a.engine_kwargs:
            extra = json.loads(a.engine_kwargs)
            if not isinstance(extra, dict):
                raise ValueError(f"--engine-kwargs must be a JSON object, got {a.engine_kwargs!r}")
            extractor_kwargs.update(extra)
    else:
        vllm_only = [f for f, v in (("--max-num-batched-tokens", a.max_num_batched_tokens),
                                    ("--tensor-parallel-size", a.tensor_parallel_size),
                                    ("--engine-kwargs", a.engine_kwargs),
                                    ("--kv-cache-memory-bytes", a.kv_cache_memory_bytes),
                                    ("--gpu-memory-utilization", a.gpu_memory_utilization))
                     if v is not None]
        if vllm_only:
            raise ValueError(f"{', '.join(vllm_only)}: vLLM engine options, not for --backend transformers")
        if a.trust_remote_code:
            extractor_kwargs["trust_remote_code"] = True
    if (a.samples_per_unit is not None or a.samples_per_shard is not None) and not a.cache:
        raise ValueError("--samples-per-unit / --samples-per-shard: only with --cache")
    cfg = OnlineConfig(
        backend=backend,
        aux_layer_ids=tuple(a.aux_layer_ids) if a.aux_layer_ids else None,
        states_dtype=a.states_dtype or "bfloat16",
        queue_depth=4 if a.queue_depth is None else a.queue_depth,
        unit_steps=8 if a.unit_steps is None else a.unit_steps,
        cache=a.cache, samples_per_unit=a.samples_per_unit,
        samples_per_shard=256 if a.samples_per_shard is None else a.samples_per_shard,
        placement=("replicas" if a.engine_replicas is not None or a.ray_address is not None
                   else "split" if a.engine_devices else "colocated"),
        engine_devices=a.engine_devices, engine_replicas=a.engine_replicas,
        ray_address=a.ray_address, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
        gpu_memory_utilization=a.gpu_memory_utilization, extractor_kwargs=extractor_kwargs,
        trainer_stream=a.trainer_stream, engine_process=a.engine_process)
    cfg.check()
    return cfg
