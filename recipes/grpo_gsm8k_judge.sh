#!/usr/bin/env bash
# GRPO on GSM8K with an instruct model as a yes/no judge, next to verl's GSM8K rule and a reward model: one 8-GPU
# node, policy on 6 GPUs, one GPU for the RM, one for the judge.
#
# Layout
#   pools of their own: an 8B RM and a 7B judge (about 30 GB in bf16) beside the rollout and the actor on
#   each GPU would leave the rollout little room.
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * RM + weight_judge * judge
#     = 1.0 * GSM8K rule + 0.1 * Skywork-Reward-Llama-3.1-8B-v0.2 + 0.5 * P(Yes) of Qwen2.5-7B-Instruct
#   Reward manager: verl's `naive` (kept as it is; rule_weight defaults to 1.0 with a manager of verl's). Its rule is
#   verl's default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground
#   truth, else 0.0.
#   RM ("main", reward.reward_model.*): Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 (LlamaForSequenceClassification).
#   Judge ("judge", +async_rm.models.judge.*): Qwen/Qwen2.5-7B-Instruct (Qwen2ForCausalLM) with reward_kind=judge and
#   the logits readout: the question, the response and the dataset's ground truth go into the default judge prompt
#   ("... Reference answer: <ground truth> ... Is the response correct? Answer Yes or No."), rendered with the judge's
#   own chat template and generation prompt; one forward, and the score is the probability of "Yes" renormalised over
#   "Yes" and "No" at the judge's next token. No generation, so it costs what an RM of its size costs.
#   Logged per sample in reward_extra_info: rm_score (the RM), rm_score_main, rm_score_judge, rm_total, rule_score;
#   per step: async_rm/* and async_rm/main/*, async_rm/judge/*.
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100). 6 for the policy (actor + vLLM rollout + reference), 1 for a
#            replica of the RM (a full bf16 copy of the 8B RM), 1 for a replica of the judge (7B, bf16).
#   Install  pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#   Models   local directories (the replicas load the models and the policy's tokenizer from disk, not from the Hub):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#              hf download Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 \
#                  --local-dir $HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2
#              hf download Qwen/Qwen2.5-7B-Instruct --local-dir $HOME/models/Qwen2.5-7B-Instruct
#            check: grep -A1 architectures $HOME/models/*/config.json prints LlamaForSequenceClassification for the RM
#                   and Qwen2ForCausalLM for the judge
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet, with the
#            ground truth the judge reads in reward_model.ground_truth
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_judge.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, RM_PATH, JUDGE_PATH and DATA_DIR (defaults below).
#   A judge that writes its verdict instead: +async_rm.models.judge.judge_readout=generate (the default prompt asks
#   for a 0-10 grade ending in "Verdict: <n>"), with vLLM in the replica; remove judge_tokens then.
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-3B-Instruct}
RM_PATH=${RM_PATH:-$HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2}
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
    trainer.experiment_name=qwen2.5-3b_judge_naive
    trainer.n_gpus_per_node=6
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: an RM and a yes/no judge, each on its own 1-GPU pool, scored as trajectories finish ---
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
    +async_rm.models.judge.model_path="$JUDGE_PATH"
    +async_rm.models.judge.reward_kind=judge
    +async_rm.models.judge.judge_tokens='[Yes,No]'
    +async_rm.models.judge.n_gpus_per_node=1
    +async_rm.models.judge.weight=0.5
    +async_rm.models.judge.max_batch_size=32
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
