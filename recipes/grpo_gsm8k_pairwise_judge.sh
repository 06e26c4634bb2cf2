#!/usr/bin/env bash
# GRPO on GSM8K with a pairwise judge next to verl's GSM8K rule: one 8-GPU node, the policy and a judge replica on
# every GPU, each prompt's 5 responses compared in pairs, each pair in both orders (verl-async-rm).
#
# Layout
#   the policy's GPUs: the judge is read at its next token on transformers, which sleeps through the update.
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * pairwise judge
#     = 1.0 * GSM8K rule (0 or 1) + 0.5 * the response's win rate against its group's others (0 to 1)
#   Reward manager: verl's `naive` (rule_weight defaults to 1.0 with a manager of verl's). Its rule is verl's
#   default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground truth.
#   Pairwise judge (the RM, reward.reward_model.*): Qwen/Qwen2.5-7B-Instruct (Qwen2ForCausalLM) with
#   reward_kind=pairwise_judge. Each trajectory's request waits until the 5 responses of its prompt have finished;
#   then its 10 pairs are each asked in both orders (pair_orders=both: 20 forwards per group, 4 per trajectory), the
#   question, the ground truth and the two responses in the default prompt, read at the next token: P(A wins) =
#   p(A) / (p(A) + p(B)). A response's reward is its mean result over its comparisons (pair_aggregate=win_rate), the
#   two orders averaged so a judge that favours a position gains nothing (async_rm/position_flip_rate shows how much
#   it does). A comparison that fails is left out; a response with none answered fails alone, never a default.
#   Logged per sample in reward_extra_info: rm_score and rm_score_main (the win rate), rm_verdict_main, rm_total,
#   rule_score; per step: async_rm/* (comparisons_per_trajectory, position_flip_rate, intransitive_rate, ties).
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100), all 8 for the policy (actor + vLLM rollout + reference) and
#            8 judge replicas beside it (7B, bf16, about 15 GB each), one per GPU. Host memory: 15 GB of pinned
#            memory per replica while it sleeps.
#   Install  pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#   Models   local directories (the replicas load the judge and the policy's tokenizer from disk, not from the Hub):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#              hf download Qwen/Qwen2.5-7B-Instruct --local-dir $HOME/models/Qwen2.5-7B-Instruct
#            check: grep -A1 architectures $HOME/models/Qwen2.5-7B-Instruct/config.json prints Qwen2ForCausalLM
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet, with the
#            ground truth the judge reads in reward_model.ground_truth
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_pairwise_judge.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, JUDGE_PATH and DATA_DIR (defaults below). The same judge at an endpoint:
#   recipes/grpo_gsm8k_pairwise_judge_remote.sh. See docs/rm-kinds.md, Pairwise judges.
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-3B-Instruct}
JUDGE_PATH=${JUDGE_PATH:-$HOME/models/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GRPO-on-GSM8K settings ---
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    data.return_raw_chat=True
    actor_rollout_ref.model.path="$POLICY_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.val_kwargs.n=2  # a pairwise judge compares a group's responses: two per prompt
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger='["console","wandb"]'
    trainer.project_name=verl_async_rm_gsm8k
    trainer.experiment_name=qwen2.5-3b_pairwise_judge_7b
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: a pairwise judge replica on each of the policy's GPUs, asleep during the update ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=False
    reward.reward_model.model_path="$JUDGE_PATH"
    reward.reward_manager.name=naive
    # reward.custom_reward_function.path stays null: the rule is verl's default_compute_score for the data source
    +async_rm.reward_kind=pairwise_judge
    +async_rm.pair_orders=both
    +async_rm.pair_aggregate=win_rate
    +async_rm.group_wait_s=300
    +async_rm.rm_weight=0.5
    +async_rm.max_length=4096
    +async_rm.max_batch_size=32
    +async_rm.max_wait_ms=20
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
