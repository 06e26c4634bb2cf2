"""Public test utilities: tiny offline models, a CPU generation server and a verl config composer.

They let tests, the demo and benchmarks run verl's real agent loop on a CPU machine with no downloads:

- :func:`build_tiny_models` builds a tiny tokenizer, policy and reward models into a cache folder;
- :class:`CPUGenerationServer` stands in for verl's vLLM server behind verl's real ``LLMServerClient``
  (:func:`start_generation_servers`, :func:`start_load_balancer`, :func:`make_llm_client`);
- :func:`compose_trainer_config` composes verl's own ``ppo_trainer`` config for those models (v0 or v1 trainer);
- :class:`TrainerRun` builds verl's real v1 trainer in this process as ``main_ppo`` does (CPU: the settings of
  :mod:`~verl_async_rm.testing.cpu_trainer`) and records each step's batch.
"""

from verl_async_rm.testing.trainer_config import compose_trainer_config, verl_config_dir
from verl_async_rm.testing.generation import (
    CPUGenerationServer,
    LengthDistribution,
    make_llm_client,
    start_generation_servers,
    start_load_balancer,
)
from verl_async_rm.testing.models import TinyModels, build_tiny_models, default_cache_dir
from verl_async_rm.testing.trainer_run import StepRecord, TrainerRun, init_ray

__all__ = [
    "TinyModels",
    "build_tiny_models",
    "default_cache_dir",
    "CPUGenerationServer",
    "LengthDistribution",
    "start_generation_servers",
    "start_load_balancer",
    "make_llm_client",
    "compose_trainer_config",
    "verl_config_dir",
    "TrainerRun",
    "StepRecord",
    "init_ray",
]
