"""vLLM's own classes, for annotations: the facades import this module under
``TYPE_CHECKING`` only, so the type checker sees real vLLM types while ``import vllm_compat``
imports nothing of vLLM. Locations are those of the release ``nox -s typecheck`` installs."""

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

__all__ = ["KVCacheConfig", "ModelRunnerOutput", "Request", "SamplingParams", "Scheduler",
           "SchedulerOutput", "VllmConfig"]
