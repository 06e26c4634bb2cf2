#!/usr/bin/env bash
# GRPO on GSM8K with a 7B policy whose rollout is tensor parallel over 2 GPUs, and an RM on its own 2 GPUs: one
# 8-GPU node, policy 6, RM 2 (verl-async-rm).
#
# Layout
#   a pool of its own to show a 6 + 2 split's sizes (the rollout's TP and the batch sizes must divide 6); on
#   one node the RM on the policy's GPUs is modelled faster (recipes/grpo_gsm8k_1node.sh, docs/benchmarks.md).
#
# What it trains
#   Policy Qwen/Qwen2.5-7B-Instruct, GRPO (5 samples per prompt), vLLM rollout with tensor_model_parallel_size=2 (three
#   rollout replicas of 2 GPUs on the policy's 6); reward = the score of the sequence-classification RM
#   Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 (LlamaForSequenceClassification, one output), scored per trajectory the
#   moment its agent loop ends, re-rendered with the RM's own (Llama 3) chat template.
#
# Sizes that divide (why these batch sizes)
#   The policy has 6 GPUs, not 8: the rollout's tensor_model_parallel_size must divide 6 (1, 2, 3 or 6; not 4 or 8),
#   and verl splits each batch of trajectories over the 6 GPUs, so train_batch_size x n and ppo_mini_batch_size x n
#   must be multiples of 6, and the per-GPU share of a mini-batch a multiple of ppo_micro_batch_size_per_gpu. Sizes
#   written for 8 GPUs (train_batch_size=256, ppo_mini_batch_size=64) do not split over 6. Here: 96 prompts x 5 = 480
#   trajectories per step (80 per GPU), mini-batches of 24 x 5 = 120 (20 per GPU, micro-batches of 4), 4 updates per
#   step.
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100). 6 for the policy (actor + vLLM rollout + reference; the 7B
#            actor's parameters, gradients and Adam states sharded over the 6 by FSDP), 2 for two RM replicas (one
#            full bf16 copy of the 8B RM per GPU).
#   Install  pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#   Models   local directories (the RM replicas load the RM and the policy's tokenizer from disk, not from the Hub):
#              hf download Qwen/Qwen2.5-7B-Instruct --local-dir $HOME/models/Qwen2.5-7B-Instruct
#              hf download Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 \
#                  --local-dir $HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2
#            check: grep -A1 architectures $HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2/config.json
#                   prints "LlamaForSequenceClassification"
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_7b_tp2.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, RM_PATH and DATA_DIR (defaults below).
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-7B-Instruct}
RM_PATH=${RM_PATH:-$HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GRPO-on-GSM8K settings ---
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=96
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    data.return_raw_chat=True
    actor_rollout_ref.model.path="$POLICY_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=24
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger='["console","wandb"]'
    trainer.project_name=verl_async_rm_gsm8k
    trainer.experiment_name=qwen2.5-7b-tp2_skywork-rm-8b_1node
    trainer.n_gpus_per_node=6
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: the RM on its own pool of 2 GPUs, scored as trajectories finish ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=True
    reward.reward_model.n_gpus_per_node=2
    reward.reward_model.nnodes=1
    reward.reward_model.model_path="$RM_PATH"
    reward.reward_manager.name=async_rm
    +async_rm.rm_weight=1.0
    +async_rm.rule_weight=0.0
    +async_rm.max_batch_size=32
    +async_rm.max_wait_ms=20
    +async_rm.max_length=2048
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
