#!/usr/bin/env bash
# GRPO on GSM8K with two reward models and verl's own naive reward manager: one 8-GPU node, policy on 6 GPUs, one GPU
# for each RM.
#
# Layout
#   pools of their own, each sized alone; on the policy's GPUs instead (at most two RMs), drop every pool
#   key and set reward.reward_model.enable_resource_pool=False, if both fit beside the rollout.
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * RM 1 + weight_second * RM 2
#     = 1.0 * GSM8K rule + 0.1 * Skywork-Reward-Llama-3.1-8B-v0.2 + 0.05 * Skywork-Reward-V2-Qwen3-0.6B
#   Reward manager: verl's `naive` (kept as it is; rule_weight defaults to 1.0 with a manager of verl's). Its rule is
#   verl's default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground
#   truth, else 0.0. A reward.custom_reward_function of yours would see both RM scores in extra_info["rm_scores"].
#   RM 1 ("main", reward.reward_model.*): Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 (LlamaForSequenceClassification,
#   Llama 3 chat template). RM 2 ("second", +async_rm.models.second.*): Skywork/Skywork-Reward-V2-Qwen3-0.6B
#   (Qwen3ForSequenceClassification, its own Qwen3 chat template). Each RM gets its own pool, replicas and batcher;
#   a trajectory goes to both at once and its reward is ready when the second answers.
#   Logged per sample in reward_extra_info: rm_score (RM 1), rm_score_main, rm_score_second, rm_total, rule_score;
#   per step: async_rm/* and async_rm/main/*, async_rm/second/*.
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100). 6 for the policy (actor + vLLM rollout + reference), 1 for a
#            replica of RM 1 (a full bf16 copy of the 8B RM), 1 for a replica of RM 2 (0.6B).
#   Install  pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#   Models   local directories (the RM replicas load the RMs and the policy's tokenizer from disk, not from the Hub):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#              hf download Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 \
#                  --local-dir $HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2
#              hf download Skywork/Skywork-Reward-V2-Qwen3-0.6B --local-dir $HOME/models/Skywork-Reward-V2-Qwen3-0.6B
#            check: grep -A1 architectures $HOME/models/*/config.json prints LlamaForSequenceClassification and
#                   Qwen3ForSequenceClassification for the two RMs
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_two_rms.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, RM_PATH, RM2_PATH and DATA_DIR (defaults below).
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-3B-Instruct}
RM_PATH=${RM_PATH:-$HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2}
RM2_PATH=${RM2_PATH:-$HOME/models/Skywork-Reward-V2-Qwen3-0.6B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GRPO-on-GSM8K settings ---
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=240
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    data.return_raw_chat=True
    actor_rollout_ref.model.path="$POLICY_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=60
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger='["console","wandb"]'
    trainer.project_name=verl_async_rm_gsm8k
    trainer.experiment_name=qwen2.5-3b_two_rms_naive
    trainer.n_gpus_per_node=6
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: two RMs, each on its own 1-GPU pool, scored as trajectories finish; verl's naive manager ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=True
    reward.reward_model.n_gpus_per_node=1
    reward.reward_model.nnodes=1
    reward.reward_model.model_path="$RM_PATH"
    reward.reward_manager.name=naive
    # reward.custom_reward_function.path stays null: the rule is verl's default_compute_score for the data source
    +async_rm.rm_weight=0.1
    +async_rm.max_batch_size=32
    +async_rm.max_wait_ms=20
    +async_rm.max_length=2048
    +async_rm.models.second.model_path="$RM2_PATH"
    +async_rm.models.second.n_gpus_per_node=1
    +async_rm.models.second.weight=0.05
    +async_rm.models.second.max_batch_size=64
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
