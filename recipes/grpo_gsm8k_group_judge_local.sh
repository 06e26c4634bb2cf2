#!/usr/bin/env bash
# GRPO on GSM8K with a group judge next to verl's GSM8K rule: one 8-GPU node, the policy on 6 GPUs, an instruct
# model on the other 2 comparing each prompt's 5 responses side by side, one judge call per group (verl-async-rm).
#
# Layout
#   a pool of its own: a group judge runs vLLM, which is not put to sleep on the policy's GPUs.
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * group judge
#     = 1.0 * GSM8K rule (0 or 1) + 0.5 * Qwen2.5-7B-Instruct's grade of the response among its group (0 to 1)
#   Reward manager: verl's `naive` (rule_weight defaults to 1.0 with a manager of verl's). Its rule is verl's
#   default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground truth.
#   Group judge (the pool's RM, reward.reward_model.*): Qwen/Qwen2.5-7B-Instruct (Qwen2ForCausalLM) with
#   reward_kind=group_judge. Each trajectory's request waits until the 5 responses of its prompt have finished, then
#   ONE judge call reads the question, the dataset's ground truth and the 5 responses, each in a block
#   <response label="n"> with labels drawn per group (the position shuffle: no response is always first), and
#   replies with a JSON object of a 0-10 grade per label. The reply is constrained to that schema by vLLM's structured output in the replica (greedy, at
#   most judge_max_tokens=64); each response's score is its label's grade / judge_scale=10. A reply that does not read
#   is asked again once (judge_retries=1: the reply and why it did not read added to the judge's conversation), then
#   every trajectory of the group fails (never a default score). A group that stays short (a sibling's agent loop
#   failed) is judged with the responses that came, group_wait_s=300 after the last one. The outcome RM of the other
#   recipes (Skywork/Skywork-Reward-Llama-3.1-8B-v0.2, LlamaForSequenceClassification) is replaced by the judge here:
#   add it as +async_rm.models.rm.* if GPUs are left.
#   Sizing: a group's judge input is the instructions, the question and 5 responses of up to 1024 tokens: about 5.8k
#   tokens, within max_length=8192 (the judge's context is 32k); a longer group fails whole with a RewardInputError
#   naming its length, never cut. One call per group instead of one per response: the question and instructions are
#   read once per group, and GRPO's within-group comparison is the judge's own.
#   Logged per sample in reward_extra_info: rm_score and rm_score_main (the grade / 10), rm_verdict_main (the
#   response's label and the judge's reply), rm_total, rule_score; per step: async_rm/* (async_rm/judge_calls,
#   groups_judged, groups_partial, group_wait_s/p99, judge_tokens_in_per_trajectory among them).
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100). 6 for the policy (actor + vLLM rollout + reference), 2 for
#            two replicas of the judge (7B, bf16), each a vLLM engine in its replica.
#   Install  pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI); vLLM runs the judge in its replicas.
#   Models   local directories (the replicas load the judge and the policy's tokenizer from disk, not from the Hub):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#              hf download Qwen/Qwen2.5-7B-Instruct --local-dir $HOME/models/Qwen2.5-7B-Instruct
#            check: grep -A1 architectures $HOME/models/Qwen2.5-7B-Instruct/config.json prints Qwen2ForCausalLM
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet, with the
#            ground truth the judge reads in reward_model.ground_truth
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_group_judge_local.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, JUDGE_PATH and DATA_DIR (defaults below). Your own prompt:
#   +async_rm.judge_prompt='...{{ prompt }}...{{ responses }}...' (see docs/rm-kinds.md, Group judges).
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
    trainer.experiment_name=qwen2.5-3b_group_judge_7b
    trainer.n_gpus_per_node=6
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: the group judge on its own 2-GPU pool, one call per GRPO group ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=True
    reward.reward_model.n_gpus_per_node=2
    reward.reward_model.nnodes=1
    reward.reward_model.model_path="$JUDGE_PATH"
    reward.reward_manager.name=naive
    # reward.custom_reward_function.path stays null: the rule is verl's default_compute_score for the data source
    +async_rm.reward_kind=group_judge
    +async_rm.judge_scale=10
    +async_rm.judge_max_tokens=64
    +async_rm.judge_retries=1
    +async_rm.group_wait_s=300
    +async_rm.rm_weight=0.5
    +async_rm.max_length=8192
    +async_rm.max_batch_size=16
    +async_rm.max_wait_ms=20
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
