"""Does the RM fit beside the policy on one GPU (``placement='policy_pool'``)? That GPU holds at once the rollout
engine's ``gpu_memory_utilization`` share, what the actor keeps there during the rollout (:func:`actor_resident_bytes`:
its FSDP shard of fp32 parameters and Adam moments unless offloaded) and the RM's weights plus one micro-batch
(:func:`rm_need_bytes`). :func:`check_colocated_memory` refuses, before loading, a replica that does not fit."""

from __future__ import annotations

from typing import Any

from verl_async_rm.errors import ConfigValueError
from verl_async_rm.options import select
from verl_async_rm.scoring.sharding import ELEMENT_BYTES, config_json, rm_weights_bytes, weights_bytes

__all__ = ["actor_resident_bytes", "rm_need_bytes", "check_colocated_memory", "ACTIVATION_FACTOR"]

_GIB = 1024**3
#: One micro-batch's working set, in hidden-state tensors of ``micro_batch_max_tokens x hidden_size``: the residual
#: stream, the attention's q/k/v/output and the MLP's wider intermediate (about 4x hidden, twice for gated MLPs),
#: rounded up. An estimate, printed in the error.
ACTIVATION_FACTOR = 16


def actor_resident_bytes(config: Any) -> int:
    """Bytes of the policy that stay on each GPU while the rollout runs, from verl's keys (module doc)."""
    path = select(config, "actor_rollout_ref.model.path")
    stored = weights_bytes(str(path)) if path else None
    if stored is None:
        return 0
    size, dtype = stored
    params = size // ELEMENT_BYTES.get(str(dtype), 2)
    gpus = int(select(config, "trainer.n_gpus_per_node") or 1) * int(select(config, "trainer.nnodes") or 1)
    per_gpu = params / max(1, gpus)
    resident = 0.0
    if not select(config, "actor_rollout_ref.actor.fsdp_config.param_offload"):
        resident += 4 * per_gpu  # fp32 parameters
    if not select(config, "actor_rollout_ref.actor.fsdp_config.optimizer_offload"):
        resident += 8 * per_gpu  # Adam's two fp32 moments
    uses_ref = select(config, "actor_rollout_ref.actor.use_kl_loss") or select(config, "algorithm.use_kl_in_reward")
    if uses_ref and not select(config, "actor_rollout_ref.ref.fsdp_config.param_offload"):
        resident += 4 * per_gpu
    return int(resident)


def rm_need_bytes(config: Any) -> tuple[int, int] | None:
    """``(weights, one micro-batch)`` bytes of the RM of ``config`` (an ``RMConfig``) on its GPU, from its
    checkpoint; None when the checkpoint has no weight files to size."""
    sized = rm_weights_bytes(config)
    if sized is None:
        return None
    weights, dtype = sized
    model_config = config_json(config.model_path)
    text = model_config.get("text_config") or model_config
    hidden = int(text.get("hidden_size") or model_config.get("hidden_size") or 0)
    batch = config.micro_batch_max_tokens * hidden * ELEMENT_BYTES[dtype] * ACTIVATION_FACTOR
    return weights, batch


def check_colocated_memory(config: Any, device_bytes: int) -> None:
    """Refuse an RM (``RMConfig`` with ``placement='policy_pool'``) that does not fit beside the policy on a GPU of
    ``device_bytes``: a ``ConfigValueError`` on ``actor_rollout_ref.rollout.gpu_memory_utilization`` naming the
    values that fit (that key, ``micro_batch_max_tokens``) or a pool of the RM's own."""
    utilization = config.rollout_memory_utilization
    need = rm_need_bytes(config)
    if utilization is None or need is None:
        return
    weights, batch = need
    actor = config.actor_resident_bytes
    left = device_bytes * (1.0 - utilization) - actor
    if weights + batch <= left:
        return
    fixes = []
    fit_utilization = int(100 * (1.0 - (weights + batch + actor) / device_bytes)) / 100
    if fit_utilization >= 0.1:
        fixes.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={fit_utilization:.2f} (less KV cache)")
    per_token = batch / config.micro_batch_max_tokens if config.micro_batch_max_tokens else 0
    if per_token and left > weights:
        tokens = int((left - weights) / per_token)
        if tokens >= 256:
            fixes.append(f"+async_rm.micro_batch_max_tokens={tokens}")
    if actor:
        fixes.append("actor_rollout_ref.actor.fsdp_config.param_offload=True and optimizer_offload=True (the actor's "
                     "state on the host during the rollout)")
    fixes.append("or give the RM its own GPUs: reward.reward_model.enable_resource_pool=True with "
                 "reward.reward_model.n_gpus_per_node")
    raise ConfigValueError(
        "actor_rollout_ref.rollout.gpu_memory_utilization", utilization,
        f"the RM on the policy's GPUs needs {(weights + batch) / _GIB:.2f} GiB awake ({weights / _GIB:.2f} GiB of "
        f"weights in its dtype + {batch / _GIB:.2f} GiB for one micro-batch of micro_batch_max_tokens="
        f"{config.micro_batch_max_tokens}, estimated), and a {device_bytes / _GIB:.1f} GiB GPU has "
        f"{max(0.0, left) / _GIB:.2f} GiB left beside the rollout engine ({utilization:g} of the GPU) and the actor "
        f"({actor / _GIB:.2f} GiB kept on each GPU during the rollout, estimated)",
        "set one of: " + "; ".join(fixes))
