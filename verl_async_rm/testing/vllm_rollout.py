"""verl's own vLLM rollout replicas and verl's own vLLM-served RM, on a CPU machine with vLLM's CPU build.

The settings here are those verl needs on CPU (``../shared/design/vllm.md`` of the project has the measurements):

- verl has no CPU platform: its pools ask Ray for GPUs, so the local cluster must advertise logical GPUs
  (``ray.init(num_gpus=N)``): one per rollout replica and one per served-RM worker;
- vLLM's CPU platform refuses sleep mode (``enable_sleep_mode=False``), the default ``load_format=dummy`` would use
  random weights (``auto``), one device per replica (``tensor_model_parallel_size=1``), eager mode starts faster;
- ``gpu_memory_utilization`` means nothing on CPU: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes each engine's KV cache;
- each vLLM engine binds its OpenMP threads to core 0 by default, so engines share one core: ``nobind`` lets the OS
  spread them (``VLLM_CPU_OMP_THREADS_BIND``).

verl's served RM (``reward.reward_model.enable=True``): with its default ``rollout.free_cache_engine=True`` and a pool
of its own, verl puts the RM engine to sleep at start and its per-trajectory path (``RewardLoopWorker.compute_score``
-> ``compute_score_disrm``, a ``/classify`` request) never wakes it, so every request hangs until verl's router gives
up; :func:`served_rm_overrides` sets ``free_cache_engine=False``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

__all__ = [
    "VLLM_ENV_DEFAULTS",
    "cpu_rollout_overrides",
    "remove_pool",
    "served_rm_overrides",
    "set_vllm_env",
    "start_vllm_rollout",
    "stop_vllm_rollout",
]

#: Environment every process that may start a vLLM engine needs on CPU (set before ``ray.init``; kept if set).
VLLM_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: Longest verl's standalone vLLM replica may take to start (about 30 s on 2 CPU cores).
START_TIMEOUT_S = 300.0


def set_vllm_env() -> None:
    """Set :data:`VLLM_ENV_DEFAULTS` in this process's environment (Ray workers started afterwards inherit them)."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def cpu_rollout_overrides(max_model_len: int, max_num_seqs: int = 64) -> list[str]:
    """Hydra overrides that run verl's vLLM rollout (``actor_rollout_ref.rollout``) on vLLM's CPU build."""
    return [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.load_format=auto",
        f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
        f"actor_rollout_ref.rollout.max_num_seqs={max_num_seqs}",
        f"actor_rollout_ref.rollout.max_num_batched_tokens={max(max_model_len, 1024)}",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    ]


def served_rm_overrides(rm_path: str, num_workers: int, max_model_len: int = 1024) -> list[str]:
    """Hydra overrides for verl's own vLLM-served RM on a pool of its own, one vLLM engine per worker, on CPU.

    ``reward.reward_model.enable=True`` with ``enable_resource_pool=True`` (the trainer's reward pool), vLLM's
    pooling runner in fp32, and ``free_cache_engine=False`` (see the module doc for the trap it avoids).
    """
    return [
        "reward.reward_model.enable=True",
        "reward.reward_model.enable_resource_pool=True",
        f"reward.reward_model.n_gpus_per_node={num_workers}",
        "reward.reward_model.nnodes=1",
        f"reward.reward_model.model_path={rm_path}",
        "reward.reward_model.rollout.name=vllm",
        "reward.reward_model.rollout.tensor_model_parallel_size=1",
        "reward.reward_model.rollout.dtype=float32",
        f"reward.reward_model.rollout.max_model_len={max_model_len}",
        "reward.reward_model.rollout.max_num_seqs=32",
        f"reward.reward_model.rollout.max_num_batched_tokens={max(max_model_len, 2048)}",
        "reward.reward_model.rollout.free_cache_engine=False",
        "+reward.reward_model.rollout.enable_sleep_mode=False",
    ]


def start_vllm_rollout(config: Any, *, replica_rank: int = 0, timeout_s: float = START_TIMEOUT_S) -> tuple[Any, Any]:
    """Start one of verl's own ``vLLMReplica`` standalone (its own one-device pool) for ``config``'s policy.

    Returns ``(replica, client)``: the replica (``replica.workers`` / ``replica.servers`` are its Ray actors) and
    verl's real ``LLMServerClient`` in front of it, through verl's router. Raises ``TimeoutError`` past ``timeout_s``.
    """
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    from verl_async_rm.testing.generation import make_llm_client

    rollout = config.actor_rollout_ref.rollout
    replica = get_rollout_replica_class(rollout.name)(
        replica_rank=replica_rank, config=rollout,
        model_config=HFModelConfig(path=config.actor_rollout_ref.model.path), gpus_per_node=1,
    )

    async def start() -> None:
        await asyncio.wait_for(replica.init_standalone(), timeout_s)

    asyncio.run(start())
    return replica, make_llm_client(config, {replica.server_address: replica.server_handle})


def stop_vllm_rollout(replica: Any) -> None:
    """Kill what a standalone replica started (its workers and HTTP servers) and remove its placement groups, so its
    GPU is free for the next test on the same cluster (verl's replica has no stop of its own)."""
    import ray

    for actor in [*getattr(replica, "workers", []), *getattr(replica, "servers", [])]:
        ray.kill(actor)
    remove_pool(getattr(replica, "resource_pool", None))


def remove_pool(pool: Any) -> None:
    """Remove the placement groups of verl's ``RayResourcePool`` ``pool`` (Ray kills the actors still in them)."""
    import ray

    for pg in getattr(pool, "pgs", None) or []:
        ray.util.remove_placement_group(pg)
