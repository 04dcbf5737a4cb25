"""The vLLM surface vllm_compat depends on, written down as data (never imports vLLM).

Every vLLM module attribute, class, method and signature that the adapters and the live-engine
drivers (``vllm_compat.runtime``) touch is one :class:`Symbol`: the capability it serves, where
it lived in the tested releases, and the signature facts the calling code relies on (the
parameters it passes, the ones it passes only where they exist). ``resolve.py``
resolves symbols from this table (at a known location, or by searching the listed packages
when vLLM moved one), and ``vllm-compat doctor --drift`` checks the installed vLLM against it
and against the stored snapshot of the nearest tested release (``vllm_compat/snapshots/``).

Beyond what vllm_compat calls, the surface lists what an adapter author must know even where
vllm_compat does not call it (``direct=False``: vLLM's block-hash functions, the engine's
hash-function choice): a change there is reported, never refused. For the classes vllm_compat
builds for vLLM or reads back from it, ``fields`` names the fields whose *types* the snapshots
record, so a changed type shows in the report instead of as vLLM's own exception in a step.

Release bounds are tested releases (``matrix/releases.toml``): ``since`` is the first one where
vllm_compat uses the symbol, ``until`` the last; outside them the symbol is neither required nor
signature-checked. ``optional`` symbols are read through a feature probe and have a fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

# What each capability is, in the words of the public API (doctor prints these).
CAPABILITIES: dict[str, str] = {
    "hashing": "make_block_hasher / block_hasher_for: block hashes equal to the engine's",
    "requests": "make_request / attach_block_hasher: a real Request on every release",
    "scheduler": "make_vllm_config / make_kv_cache_config / make_scheduler / schedule / update_from_output",
    "model-step": "run_model_step / StepPipeline / make_model_runner_output / grammar_output / collective_rpc",
    "engine": "an LLM for serving, evaluation and extraction (vllm_compat.runtime.llm)",
    "extraction": "HiddenStatesExtractor: aux, hooks and native capture (vllm_compat.runtime.extraction)",
    "speculative": "eagle3 validate: what vLLM builds from an EAGLE-3 checkpoint (vllm_compat.runtime.speculative)",
}

KCU = "vllm.v1.core.kv_cache_utils"
HASHING = "vllm.utils.hashing"
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
HASH_SEARCH = ("vllm.utils", "vllm.v1.core")


@dataclass(frozen=True)
class Location:
    """``module:attr``, for the tested releases ``since``..``until`` (None: open-ended)."""

    module: str
    attr: str = ""  # empty for a module itself
    since: str | None = None
    until: str | None = None
    # a place vLLM may move the symbol to (never seen in a tested release): used, reported as moved
    alternate: bool = False

    @property
    def where(self) -> str:
        return f"{self.module}:{self.attr}" if self.attr else self.module


@dataclass(frozen=True)
class Symbol:
    key: str  # "Request", "Request.update_block_hashes" (a member of the entry "Request")
    capability: str
    locations: tuple[Location, ...] = ()  # empty for a member: found on its parent
    kind: str = "callable"  # callable | class | value | module
    since: str | None = None
    until: str | None = None
    optional: bool = False
    # packages whose modules are searched when no location has it (vLLM moved it)
    search: tuple[str, ...] = ()
    # a value that lives beside another symbol (NONE_HASH beside init_none_hash): looked up
    # first in the module where that one was found
    beside: str | None = None
    # signature facts: leading positional arguments passed, keywords always passed, keywords
    # passed only where the signature has them (probed); any other required parameter is drift
    positional: int = 0
    passes: tuple[str, ...] = ()
    passes_if_accepted: tuple[str, ...] = ()
    called: bool = False  # called with no argument (checked: it must not require one)
    returns: str | None = None  # a return contract checked by the resolver (see resolve)
    # fields of a class vllm_compat builds or reads back, whose types the snapshots record
    fields: tuple[str, ...] = ()
    # False: vllm_compat never calls it (vLLM's own machinery behind a capability); a change
    # is reported for adapter authors and affects no capability
    direct: bool = True
    workaround: str = ""  # "{param}" is replaced by the new required parameter
    used_by: str = ""  # the vllm_compat code that uses it

    @property
    def parent(self) -> str | None:
        return self.key.rpartition(".")[0] or None if "." in self.key and not self.locations else None

    @property
    def member(self) -> str:
        return self.key.rpartition(".")[2]


def _loc(module: str, attr: str = "", since: str | None = None, until: str | None = None,
         alternate: bool = False) -> Location:
    return Location(module, attr, since, until, alternate)


def _member(key: str, capability: str, **kw) -> Symbol:
    return Symbol(key, capability, (), **kw)


REQUEST_WORKAROUND = ("pass it through make_request(..., {param}=...): make_request forwards extra "
                      "keywords to Request unchanged")

SYMBOLS: tuple[Symbol, ...] = (
    # ------------------------------------------------------------------ hashing
    Symbol("init_none_hash", "hashing",
           (_loc(KCU, "init_none_hash"), _loc(HASHING, "init_none_hash", alternate=True)),
           search=HASH_SEARCH, positional=1, used_by="make_block_hasher"),
    # only an annotation until init_none_hash runs (every release)
    Symbol("NONE_HASH", "hashing",
           (_loc(KCU, "NONE_HASH"), _loc(HASHING, "NONE_HASH", alternate=True)),
           kind="value", search=HASH_SEARCH, beside="init_none_hash", used_by="make_block_hasher"),
    # 0.29: NONE_HASH seeded from this constant for sha256 (probe fixed_none_hash_seed)
    Symbol("DEFAULT_NONE_HASH_SEED", "hashing",
           (_loc(KCU, "DEFAULT_NONE_HASH_SEED", since="0.29.0"),
            _loc(HASHING, "DEFAULT_NONE_HASH_SEED", alternate=True)),
           kind="value", since="0.29.0", optional=True, search=HASH_SEARCH, beside="init_none_hash",
           used_by="probe fixed_none_hash_seed"),
    Symbol("get_request_block_hasher", "hashing", (_loc(KCU, "get_request_block_hasher"),),
           search=HASH_SEARCH, positional=2, passes_if_accepted=("num_hash_lookahead_tokens",),
           used_by="make_block_hasher"),
    # vLLM's block-hash functions behind get_request_block_hasher (every release)
    Symbol("hash_block_tokens", "hashing", (_loc(KCU, "hash_block_tokens"),), search=HASH_SEARCH,
           direct=False, used_by="vLLM's request block hasher (one hash per full block)"),
    Symbol("generate_block_hash_extra_keys", "hashing",
           (_loc(KCU, "generate_block_hash_extra_keys"),), search=HASH_SEARCH, direct=False,
           used_by="vLLM's request block hasher (multi-modal, LoRA, cache_salt keys)"),
    # the engine's hash-function choice: EngineCore.__init__ builds its request hasher from
    # get_hash_fn_by_name(cache_config.prefix_caching_hash_algo) (probe engine_hash_algo)
    Symbol("EngineCore", "hashing", (_loc("vllm.v1.engine.core", "EngineCore"),), kind="class",
           search=("vllm.v1.engine",), direct=False,
           used_by="block_hasher_for (an engine's own hasher), doctor's engine-hash check"),
    _member("EngineCore.__init__", "hashing", direct=False,
            used_by="probe engine_hash_algo; doctor's engine-hash check replays its hasher set-up"),
    # 0.11 moved the hash helpers from vllm.utils to vllm.utils.hashing
    Symbol("get_hash_fn_by_name", "hashing",
           (_loc("vllm.utils", "get_hash_fn_by_name", until="0.10.2"),
            _loc(HASHING, "get_hash_fn_by_name", since="0.11.2")),
           search=HASH_SEARCH, positional=1, returns="hash_fn", used_by="make_block_hasher"),
    Symbol("PrefixCachingHashAlgo", "hashing", (_loc("vllm.config.cache", "PrefixCachingHashAlgo"),),
           kind="value", search=("vllm.config",), used_by="make_block_hasher (algorithm names)"),
    Symbol("vllm.utils.hashing", "hashing", (_loc(HASHING, since="0.11.2"),), kind="module",
           since="0.11.2", used_by="hash helpers (0.11+)"),
    # ------------------------------------------------------------------ requests
    Symbol("Request", "requests", (_loc("vllm.v1.request", "Request"),), kind="class",
           search=("vllm.v1",),
           fields=("block_hashes", "num_computed_tokens", "num_prompt_tokens", "status"),
           passes=("request_id", "prompt_token_ids", "sampling_params", "pooling_params",
                   "block_hasher"),
           # eos_token_id through 0.16, structured_output_request in 0.10 (the era modules)
           passes_if_accepted=("eos_token_id", "structured_output_request"),
           workaround=REQUEST_WORKAROUND, used_by="make_request"),
    # 0.16.0 replaced get_hash_new_full_blocks by _block_hasher + update_block_hashes()
    _member("Request.update_block_hashes", "requests", called=True, since="0.16.0", optional=True,
            used_by="attach_block_hasher"),
    _member("Request.append_output_token_ids", "requests", positional=1,
            used_by="StepPipeline, the scheduler"),
    Symbol("RequestStatus", "requests", (_loc("vllm.v1.request", "RequestStatus"),), kind="class",
           search=("vllm.v1",), used_by="HiddenStatesExtractor.abort"),
    _member("RequestStatus.FINISHED_ABORTED", "requests", kind="value",
            used_by="HiddenStatesExtractor.abort"),
    Symbol("SamplingParams", "requests", (_loc("vllm.sampling_params", "SamplingParams"),),
           kind="class", search=("vllm",), passes_if_accepted=("max_tokens", "temperature",
                                                                "ignore_eos", "detokenize"),
           used_by="make_request, the engine drivers"),
    _member("SamplingParams.clone", "requests", called=True, used_by="make_request(eos_token_id=...)"),
    _member("SamplingParams.update_from_generation_config", "requests", positional=2,
            used_by="make_request(eos_token_id=...)"),
    # 0.10.2 built the structured-output request outside Request (v0_10 adapter)
    Symbol("StructuredOutputRequest", "requests",
           (_loc("vllm.v1.structured_output.request", "StructuredOutputRequest", until="0.10.2"),),
           kind="class", until="0.10.2", passes=("sampling_params",), used_by="make_request (0.10)"),
    # ------------------------------------------------------------------ scheduler
    Symbol("VllmConfig", "scheduler", (_loc("vllm.config", "VllmConfig"),), kind="class",
           passes=("model_config", "cache_config", "scheduler_config", "device_config"),
           used_by="make_vllm_config"),
    Symbol("ModelConfig", "scheduler", (_loc("vllm.config", "ModelConfig"),), kind="class",
           passes_if_accepted=("model", "tokenizer", "skip_tokenizer_init", "dtype", "enforce_eager",
                               "max_model_len", "seed", "use_async_output_proc"),
           used_by="make_vllm_config"),
    Symbol("CacheConfig", "scheduler", (_loc("vllm.config", "CacheConfig"),), kind="class",
           passes_if_accepted=("block_size", "enable_prefix_caching", "prefix_caching_hash_algo"),
           fields=("block_size", "enable_prefix_caching", "prefix_caching_hash_algo"),
           used_by="make_vllm_config"),
    Symbol("SchedulerConfig", "scheduler", (_loc("vllm.config", "SchedulerConfig"),), kind="class",
           passes_if_accepted=("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                               "enable_chunked_prefill", "async_scheduling", "is_encoder_decoder"),
           used_by="make_vllm_config"),
    # 0.11 added get_scheduler_cls(); 0.10.2 had the scheduler_cls qualname string
    _member("SchedulerConfig.get_scheduler_cls", "scheduler", called=True, since="0.11.2",
            used_by="make_scheduler"),
    Symbol("resolve_obj_by_qualname", "scheduler", (_loc("vllm.utils", "resolve_obj_by_qualname",
                                                         until="0.10.2"),),
           until="0.10.2", positional=1, used_by="make_scheduler (0.10)"),
    Symbol("DeviceConfig", "scheduler", (_loc("vllm.config", "DeviceConfig"),), kind="class",
           passes=("device",), used_by="make_vllm_config"),
    Symbol("Scheduler", "scheduler", (_loc("vllm.v1.core.sched.scheduler", "Scheduler"),),
           kind="class", search=("vllm.v1.core",),
           passes=("vllm_config", "kv_cache_config", "structured_output_manager",
                   "include_finished_set", "log_stats"),
           # block_size required from 0.11, hash_block_size optional from 0.20
           passes_if_accepted=("block_size", "hash_block_size"), used_by="make_scheduler"),
    Symbol("AsyncScheduler", "scheduler", (_loc("vllm.v1.core.sched.async_scheduler",
                                                "AsyncScheduler"),),
           kind="class", search=("vllm.v1.core",), used_by="make_scheduler(async_scheduling=True)"),
    # 0.24 added throttle_prefills=False
    _member("Scheduler.schedule", "scheduler", passes_if_accepted=("throttle_prefills",),
            used_by="schedule"),
    _member("Scheduler.update_from_output", "scheduler", positional=2, used_by="update_from_output"),
    # what schedule() and update_from_output() hand back, read by StepPipeline and callers
    Symbol("SchedulerOutput", "scheduler", (_loc("vllm.v1.core.sched.output", "SchedulerOutput"),),
           kind="class", search=("vllm.v1.core",), optional=True,
           fields=("scheduled_new_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
                   "finished_req_ids"),
           used_by="StepPipeline (what schedule() returns)"),
    Symbol("EngineCoreOutput", "scheduler", (_loc("vllm.v1.engine", "EngineCoreOutput"),),
           kind="class", search=("vllm.v1.engine",), optional=True,
           fields=("request_id", "new_token_ids", "finish_reason"),
           used_by="update_from_output's result (read by callers)"),
    _member("Scheduler.add_request", "scheduler", positional=1, used_by="the scheduler drivers"),
    _member("Scheduler.get_num_unfinished_requests", "scheduler", called=True, used_by="StepPipeline"),
    _member("Scheduler.has_unfinished_requests", "scheduler", called=True, used_by="StepPipeline, extraction"),
    _member("Scheduler.finish_requests", "scheduler", positional=2,
            used_by="HiddenStatesExtractor.abort"),
    # 0.11: (scheduler_output) -> GrammarOutput | None (0.10.2 took other arguments, unused)
    _member("Scheduler.get_grammar_bitmask", "model-step", since="0.11.2", positional=1,
            used_by="grammar_output"),
    Symbol("StructuredOutputManager", "scheduler", (_loc("vllm.v1.structured_output",
                                                         "StructuredOutputManager"),),
           kind="class", search=("vllm.v1",), positional=1, used_by="make_scheduler"),
    Symbol("FullAttentionSpec", "scheduler", (_loc("vllm.v1.kv_cache_interface",
                                                   "FullAttentionSpec"),),
           kind="class", search=("vllm.v1",),
           passes=("block_size", "num_kv_heads", "head_size", "dtype"),
           passes_if_accepted=("use_mla",),  # a required field in 0.10.2 only
           fields=("block_size", "num_kv_heads", "head_size", "dtype"),
           used_by="make_kv_cache_config"),
    Symbol("KVCacheConfig", "scheduler", (_loc("vllm.v1.kv_cache_interface", "KVCacheConfig"),),
           kind="class", search=("vllm.v1",),
           passes=("num_blocks", "kv_cache_tensors", "kv_cache_groups"),
           fields=("num_blocks", "kv_cache_tensors", "kv_cache_groups"),
           used_by="make_kv_cache_config"),
    Symbol("KVCacheGroupSpec", "scheduler", (_loc("vllm.v1.kv_cache_interface",
                                                  "KVCacheGroupSpec"),),
           kind="class", search=("vllm.v1",), positional=2, used_by="make_kv_cache_config"),
    # 0.20 added resolve_kv_cache_block_sizes; before it the hash block size was block_size
    Symbol("resolve_kv_cache_block_sizes", "scheduler",
           (_loc(KCU, "resolve_kv_cache_block_sizes", since="0.20.2"),),
           since="0.20.2", optional=True, search=HASH_SEARCH, positional=2,
           used_by="make_scheduler"),
    Symbol("SingleTypeKVCacheManager", "scheduler",
           (_loc("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager"),),
           kind="class", search=("vllm.v1.core",), optional=True,
           used_by="probe missing_hasher_tolerated"),
    _member("SingleTypeKVCacheManager.cache_blocks", "scheduler", optional=True,
            used_by="probe missing_hasher_tolerated"),
    # ------------------------------------------------------------------ model step
    Symbol("ModelRunnerOutput", "model-step", (_loc("vllm.v1.outputs", "ModelRunnerOutput"),),
           kind="class", search=("vllm.v1",),
           passes=("req_ids", "sampled_token_ids"),
           # no defaults in 0.10-0.13; req_id_to_index: gone in 0.34
           passes_if_accepted=("req_id_to_index", "logprobs", "prompt_logprobs_dict", "pooler_output"),
           fields=("req_ids", "req_id_to_index", "sampled_token_ids", "logprobs",
                   "prompt_logprobs_dict", "pooler_output"),
           used_by="make_model_runner_output, update_from_output"),
    Symbol("AsyncModelRunnerOutput", "model-step", (_loc("vllm.v1.outputs",
                                                         "AsyncModelRunnerOutput"),),
           kind="class", search=("vllm.v1",), used_by="resolve_output, collective_rpc"),
    _member("AsyncModelRunnerOutput.get_output", "model-step", called=True, used_by="resolve_output"),
    Symbol("Executor", "model-step", (_loc("vllm.v1.executor.abstract", "Executor"),),
           kind="class", search=("vllm.v1.executor",), used_by="probe two_phase_step"),
    # 0.11 split the step: execute_model returns None, sample_tokens(grammar_output) samples
    _member("Executor.sample_tokens", "model-step", since="0.11.2", positional=1,
            used_by="run_model_step, StepPipeline"),
    _member("Executor.execute_model", "model-step", positional=1,
            used_by="run_model_step, StepPipeline"),
    # the objects run_model_step is handed: the same two-phase methods on workers and runners
    Symbol("Worker", "model-step", (_loc("vllm.v1.worker.gpu_worker", "Worker"),), kind="class",
           search=("vllm.v1.worker",), direct=False, used_by="run_model_step (a Worker target)"),
    _member("Worker.execute_model", "model-step", positional=1, direct=False,
            used_by="run_model_step (a Worker target)"),
    _member("Worker.sample_tokens", "model-step", since="0.11.2", positional=1, direct=False,
            used_by="run_model_step (a Worker target)"),
    _member("GPUModelRunner.sample_tokens", "model-step", since="0.11.2", positional=1,
            direct=False, used_by="run_model_step (a model runner target)"),
    _member("Executor.collective_rpc", "model-step", positional=1,
            passes=("timeout", "args", "kwargs"), used_by="collective_rpc"),
    Symbol("vllm.v1.worker.gpu.model_runner", "model-step",
           (_loc("vllm.v1.worker.gpu.model_runner", since="0.12.0"),), kind="module",
           since="0.12.0", optional=True, used_by="probe model_runner_v2_available"),
    # ------------------------------------------------------------------ engine (runtime/)
    Symbol("LLM", "engine", (_loc("vllm", "LLM"),), kind="class",
           passes=("model", "enforce_eager", "gpu_memory_utilization", "seed"),
           passes_if_accepted=("disable_log_stats", "max_model_len", "speculative_config"),
           used_by="runtime.llm.open_llm, HiddenStatesExtractor"),
    _member("LLM.generate", "engine", positional=2, passes_if_accepted=("use_tqdm",),
            used_by="runtime.llm.generate"),
    _member("LLM.get_metrics", "engine", called=True, used_by="eagle3 evaluate"),
    Symbol("TokensPrompt", "engine", (_loc("vllm.inputs", "TokensPrompt"),), kind="class",
           used_by="runtime.llm.generate"),
    Symbol("EngineArgs", "engine", (_loc("vllm.engine.arg_utils", "EngineArgs"),), kind="class",
           passes=("model", "skip_tokenizer_init", "enable_prefix_caching",
                   "tensor_parallel_size", "enforce_eager", "gpu_memory_utilization", "seed"),
           used_by="HiddenStatesExtractor (the LLM keywords it sets)"),
    Symbol("cleanup_dist_env_and_memory", "engine",
           (_loc("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory"),),
           optional=True, used_by="runtime.llm.free_gpu_memory"),
    # the process-wide CUDA-graph pool handle lives on the platform class (0.10.2-0.34)
    Symbol("current_platform", "engine", (_loc("vllm.platforms", "current_platform"),),
           kind="value", optional=True, used_by="runtime.llm.reset_cuda_graph_pool"),
    # ------------------------------------------------------------------ extraction (runtime/)
    # 0.34 removed the V1 runner: Model Runner V2's class is the only GPUModelRunner
    Symbol("GPUModelRunner", "extraction", (_loc("vllm.v1.worker.gpu_model_runner",
                                                 "GPUModelRunner", until="0.33.0"),
                                            _loc("vllm.v1.worker.gpu.model_runner",
                                                 "GPUModelRunner", since="0.34.0")),
           kind="class", search=("vllm.v1.worker",), used_by="aux capture (wraps load_model)"),
    _member("GPUModelRunner.load_model", "extraction", used_by="aux capture"),
    Symbol("ModelRegistry", "extraction", (_loc("vllm.model_executor.models.registry",
                                                "ModelRegistry"),),
           kind="value", search=("vllm.model_executor.models",), used_by="capture plan"),
    _member("ModelRegistry._try_load_model_cls", "extraction", positional=1,
            used_by="capture plan"),
    _member("ModelRegistry.get_supported_archs", "speculative", called=True, used_by="eagle3 validate"),
    # 0.18.1: EagleModelMixin (index 0 = embeddings) for Llama/Qwen inner models
    Symbol("EagleModelMixin", "extraction", (_loc("vllm.model_executor.models.interfaces",
                                                  "EagleModelMixin", since="0.18.1"),),
           kind="class", since="0.18.1", optional=True, search=("vllm.model_executor.models",),
           used_by="capture plan (which layer ids the aux path returns)"),
    Symbol("DeepseekV2ForCausalLM", "extraction",
           (_loc("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM"),),
           kind="class", optional=True, used_by="capture plan (MLA models)"),
    Symbol("DeepseekV2Model", "extraction",
           (_loc("vllm.model_executor.models.deepseek_v2", "DeepseekV2Model"),),
           kind="class", optional=True, used_by="aux capture (probe deepseek_aux_final_state)"),
    _member("DeepseekV2Model.forward", "extraction", optional=True, direct=False,
            used_by="probe deepseek_aux_final_state"),
    # where vLLM decides a multimodal model without a tokenizer runs text-only (0.21 in
    # MultiModalRegistry, later in ModelConfig): probe text_only_without_tokenizer
    Symbol("MultiModalRegistry", "engine",
           (_loc("vllm.multimodal.registry", "MultiModalRegistry"),), kind="class",
           optional=True, direct=False, used_by="probe text_only_without_tokenizer"),
    _member("MultiModalRegistry.supports_multimodal_inputs", "engine", optional=True,
            direct=False, used_by="probe text_only_without_tokenizer"),
    _member("ModelConfig._supports_multimodal_inputs", "engine", optional=True, direct=False,
            used_by="probe text_only_without_tokenizer"),
    # 0.15.0 added Kimi-K2.5 (vllm#33131); its language model is a DeepseekV2ForCausalLM
    Symbol("KimiK25ForConditionalGeneration", "extraction",
           (_loc("vllm.model_executor.models.kimi_k25", "KimiK25ForConditionalGeneration",
                 since="0.15.0"),),
           kind="class", since="0.15.0", optional=True,
           used_by="capture plan (Kimi-K2.5 takes the DeepSeek-V2 rules)"),
    Symbol(CONNECTOR, "extraction", (_loc(CONNECTOR, since="0.17.1"),), kind="module",
           since="0.17.1", optional=True, used_by="backend='native'"),
    Symbol("disable_envs_cache", "extraction", (_loc("vllm.envs", "disable_envs_cache"),),
           optional=True, used_by="HiddenStatesExtractor (a second engine in one process)"),
    # ------------------------------------------------------------------ speculative (runtime/)
    Symbol("SpeculatorsConfig", "speculative",
           (_loc("vllm.transformers_utils.configs.speculators.base", "SpeculatorsConfig"),),
           kind="class", search=("vllm.transformers_utils",), used_by="eagle3 validate"),
    _member("SpeculatorsConfig.validate_speculators_config", "speculative", positional=1,
            used_by="eagle3 validate"),
    # 0.11 split the translation out as extract_vllm_speculative_config
    _member("SpeculatorsConfig.extract_vllm_speculative_config", "speculative", since="0.11.2",
            positional=1, used_by="eagle3 validate"),
    _member("SpeculatorsConfig.convert_speculators_to_vllm", "speculative", until="0.10.2",
            positional=1, used_by="eagle3 validate (0.10)"),
    _member("SpeculatorsConfig.from_pretrained", "speculative", positional=1,
            used_by="eagle3 validate"),
    Symbol("SpeculativeConfig", "speculative", (_loc("vllm.config", "SpeculativeConfig"),),
           kind="class",
           passes=("model", "method", "num_speculative_tokens", "target_model_config",
                   "target_parallel_config"),
           used_by="eagle3 validate"),
    Symbol("vllm.model_executor.models.llama_eagle3", "speculative",
           (_loc("vllm.model_executor.models.llama_eagle3"),), kind="module",
           used_by="eagle3 validate (fc width)"),
)

BY_KEY: dict[str, Symbol] = {s.key: s for s in SYMBOLS}


@dataclass(frozen=True)
class Probe:
    """A feature probe: what it reads (a symbol) and how. ``test`` is ``exists``,
    ``param:<name>`` (the symbol's signature has it) or ``source:<text>`` (its source has it).

    Tri-state: yes / no / cannot tell. An ``exists`` probe says no only when its ``anchor``
    (the symbol it would live beside) was found; a signature or source probe cannot tell when
    its symbol is missing or unreadable."""

    name: str
    capability: str
    symbol: str
    test: str = "exists"
    anchor: str | None = None
    era_defining: bool = False
    meaning: str = ""
    # other symbols read with the same test (where vLLM moved the code): yes when any says yes
    alternates: tuple[str, ...] = ()


PROBES: tuple[Probe, ...] = (
    Probe("two_phase_step", "model-step", "Executor.sample_tokens", anchor="Executor",
          era_defining=True, meaning="execute_model + sample_tokens (0.11+)"),
    Probe("request_takes_eos", "requests", "Request", "param:eos_token_id", era_defining=True,
          meaning="Request(eos_token_id=...) (through 0.16)"),
    Probe("fixed_none_hash_seed", "hashing", "DEFAULT_NONE_HASH_SEED", anchor="init_none_hash",
          era_defining=True, meaning="NONE_HASH fixed for sha256 (0.29+)"),
    Probe("request_takes_structured_output_request", "requests", "Request",
          "param:structured_output_request", meaning="0.10"),
    Probe("request_update_block_hashes", "requests", "Request.update_block_hashes",
          anchor="Request", meaning="0.16+"),
    Probe("hashing_module", "hashing", "vllm.utils.hashing", anchor=None, meaning="0.11+"),
    Probe("hasher_lookahead_tokens", "hashing", "get_request_block_hasher",
          "param:num_hash_lookahead_tokens", meaning="0.33+"),
    Probe("scheduler_takes_block_size", "scheduler", "Scheduler", "param:block_size",
          meaning="0.11+"),
    Probe("scheduler_takes_hash_block_size", "scheduler", "Scheduler", "param:hash_block_size",
          meaning="0.20+"),
    Probe("schedule_takes_throttle_prefills", "scheduler", "Scheduler.schedule",
          "param:throttle_prefills", meaning="0.24+"),
    Probe("missing_hasher_tolerated", "scheduler", "SingleTypeKVCacheManager.cache_blocks",
          "source:num_hashed_tokens", meaning="0.33+"),
    Probe("model_runner_v2_available", "model-step", "vllm.v1.worker.gpu.model_runner",
          anchor=None, meaning="0.12+"),
    Probe("native_extract_hidden_states", "extraction", CONNECTOR, anchor=None,
          meaning="0.17.1+"),
    # vllm#46973 (0.25.0): DeepseekV2Model also captures hidden_states + residual at
    # end_layer, after its loop, so its aux path returns the final state L
    Probe("deepseek_aux_final_state", "extraction", "DeepseekV2Model.forward",
          "source:self.end_layer in self.aux_hidden_state_layers", meaning="0.25+"),
    # 0.21: a multimodal model whose processing info needs a tokenizer starts text-only
    # without one (the error is caught); 0.15-0.20 fail the engine start
    Probe("text_only_without_tokenizer", "engine", "MultiModalRegistry.supports_multimodal_inputs",
          "source:treated as multimodal but has no registered",
          alternates=("ModelConfig._supports_multimodal_inputs",), meaning="0.21+"),
    Probe("engine_hash_algo", "hashing", "EngineCore.__init__", "source:prefix_caching_hash_algo",
          meaning="the engine hashes blocks with cache_config.prefix_caching_hash_algo (every release)"),
)

PROBES_BY_NAME: dict[str, Probe] = {p.name: p for p in PROBES}
