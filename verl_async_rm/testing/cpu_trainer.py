"""verl's own trainer (``python -m verl.trainer.main_ppo``) on a CPU-only machine: the Hydra overrides it takes, for
``recipes/grpo_cpu_tiny.sh``, the demo and the trainer-level tests (one list, so they cannot drift apart; a unit test
checks the recipe against it).

Why each group (the platform itself is :mod:`verl_async_rm.cpu_platform`, active in every process on such a machine):

- **policy on CPU**: verl's FSDP2 engine (``actor.strategy=fsdp2``: the FSDP1 path builds a ``"cpu:cpu"`` backend),
  no padding removal (it packs for flash-attention), sdpa attention (``HFModelConfig`` asks for flash_attention_2),
  torch.compile and gradient checkpointing off, fp32 mixed precision for the actor and the reference (the reference
  would run in bf16 and disagree with the actor's fp32 log-probs);
- **verl's vLLM rollout on vLLM's CPU build**: :func:`verl_async_rm.testing.vllm_rollout.cpu_rollout_overrides`
  (no sleep mode, real weights, eager, fp32) and small weight-sync buckets (verl's default is 2 GB of shared memory);
- **a small local cluster**: one logical GPU for the policy and one per RM pool (``ray_init.num_gpus``: verl's pools
  ask Ray for GPUs), 16 logical CPUs (TransferQueue and verl's workers want more than 2), one TransferQueue storage
  unit (its default of 8 hangs when Ray has too few CPUs), one agent-loop and one reward-loop worker;
- **sizes**: ``train_batch_size`` prompts x ``rollout_n`` responses per step, short prompts and responses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["CPU_ENV", "cpu_env", "cpu_trainer_overrides", "plugin_overrides"]

#: Environment a CPU run needs in every process (kept where the caller set it).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per vLLM engine (gpu_memory_utilization means nothing on CPU)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # vLLM binds every engine to core 0 otherwise
    "TOKENIZERS_PARALLELISM": "false",
}
#: fp32 mixed precision of an FSDP2 engine (Hydra's dict syntax, one shell word).
FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"


def cpu_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`CPU_ENV` where unset."""
    env = dict(os.environ if base is None else base)
    for key, value in CPU_ENV.items():
        env.setdefault(key, value)
    return env


def cpu_trainer_overrides(
    *,
    policy_path: str,
    train_files: str,
    val_files: str,
    train_batch_size: int = 8,
    rollout_n: int = 4,
    max_prompt_length: int = 64,
    max_response_length: int = 32,
    lr: float = 1e-3,
    use_kl_loss: bool = True,
    rm_gpus: int = 1,
) -> list[str]:
    """GRPO with verl's v1 trainer on CPU (module doc); ``rm_gpus``: logical GPUs the RM pools take beside the
    policy's one (0: none, the RM on the policy's GPU or no RM). Extra overrides given after these replace them
    (Hydra: the last value wins)."""
    max_model_len = max_prompt_length + max_response_length
    from verl_async_rm.testing.vllm_rollout import cpu_rollout_overrides

    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={train_files}",
        f"data.val_files={val_files}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={policy_path}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
        f"actor_rollout_ref.actor.optim.lr={lr:g}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={train_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={train_batch_size * rollout_n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={train_batch_size * rollout_n}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={train_batch_size * rollout_n}",
        f"actor_rollout_ref.actor.use_kl_loss={use_kl_loss}",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        *[o for o in cpu_rollout_overrides(max_model_len, max_num_seqs=train_batch_size * rollout_n)
          if not o.startswith(("actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node"))],
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.total_epochs=1",
        f"+ray_kwargs.ray_init.num_gpus={1 + rm_gpus}",
        "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "trainer.logger=[console]",
    ]


def plugin_overrides(rm_path: str, *, rm_gpus: int = 1, extra: Sequence[str] = ()) -> list[str]:
    """The README's opt-in: the plugin's manager and reward manager, the RM on a pool of ``rm_gpus`` of its own, or
    on the policy's GPUs (``rm_gpus=0``: ``enable_resource_pool=False``, one replica beside the actor on each)."""
    pool = ["reward.reward_model.enable_resource_pool=False"] if rm_gpus == 0 else [
        "reward.reward_model.enable_resource_pool=True",
        f"reward.reward_model.n_gpus_per_node={rm_gpus}",
        "reward.reward_model.nnodes=1",
    ]
    return [
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager",
        *pool,
        f"reward.reward_model.model_path={rm_path}",
        "reward.reward_manager.name=async_rm",
        *extra,
    ]
