#!/usr/bin/env bash
# REINFORCE++ on GSM8K with an outcome RM and a process RM (step rewards on their tokens), verl's naive reward manager:
# one 8-GPU node, policy on 6 GPUs, one GPU for each RM.
#
# Layout
#   pools of their own: an 8B RM and a 7B PRM (about 30 GB in bf16) beside the rollout and the actor on
#   each GPU would leave the rollout little room.
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, REINFORCE++ (algorithm.adv_estimator=reinforce_plus_plus, 5 samples per prompt).
#   Reward per trajectory, spread over its tokens:
#     - each reasoning step (the response split at blank lines, "\n\n") gets 0.1 x the PRM's probability that the
#       step is correct, on the response token where the step ends (process_reduction=none);
#     - the last token gets 1.0 x GSM8K rule + 0.1 x the outcome RM's score.
#     verl's rm_scores (token_level_scores) hold exactly these values and sum to the trajectory's reward.
#   Why REINFORCE++, not GRPO: only an estimator that reads each token's reward sees where the steps are. GRPO (and
#   rloo, grpo_passk, opo, gpg, reinforce_plus_plus_baseline, gdpo) reads one sum per response, so with
#   process_reduction=none a response with more steps would simply earn more (the plugin warns at start). REINFORCE++
#   credits each token with the rewards from there to the end (algorithm.gamma, verl's default 1.0), so a step's tokens
#   are credited with that step and the later ones; it needs no critic (verl turns the critic off for it) and no group.
#   The first tokens still count every step, so more steps still pay a little: the PRM's weight (0.1 a step) is kept
#   small next to the rule (1.0). With GRPO, keep process_reduction=min (the default, as
#   recipes/grpo_gsm8k_prm72b_sharded.sh does); docs/rm-kinds.md says what each estimator does with step rewards.
#   Reward manager: verl's `naive` (rule_weight defaults to 1.0 with a manager of verl's); its rule is verl's
#   default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground truth.
#   Outcome RM ("main", reward.reward_model.*): Skywork/Skywork-Reward-Llama-3.1-8B-v0.2
#   (LlamaForSequenceClassification, Llama 3 chat template).
#   Process RM ("prm", +async_rm.models.prm.*): Qwen/Qwen2.5-Math-PRM-7B (Qwen2ForProcessRewardModel, its own code:
#   trust_remote_code; two labels read at the <extra_0> token it expects after each step, as its model card does).
#   Logged per sample in reward_extra_info: rm_score (main), rm_score_prm (the sum of the PRM's raw step
#   probabilities, before its weight), rm_total, rule_score; per step: async_rm/*, async_rm/main/*, async_rm/prm/*
#   (async_rm/prm/steps_dropped counts steps left unscored by max_length).
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100). 6 for the policy (actor + vLLM rollout + reference), 1 for a
#            replica of the outcome RM (a full bf16 copy of the 8B RM), 1 for a replica of the 7B PRM.
#   Install  pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#   Models   local directories (the RM replicas load the RMs and the policy's tokenizer from disk, not from the Hub):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#              hf download Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 \
#                  --local-dir $HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2
#              hf download Qwen/Qwen2.5-Math-PRM-7B --local-dir $HOME/models/Qwen2.5-Math-PRM-7B
#            check: grep -A1 architectures $HOME/models/*/config.json prints LlamaForSequenceClassification and
#                   Qwen2ForProcessRewardModel for the two RMs
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/reinforce_plus_plus_gsm8k_prm_steps.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, RM_PATH, PRM_PATH and DATA_DIR (defaults below).
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-3B-Instruct}
RM_PATH=${RM_PATH:-$HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2}
PRM_PATH=${PRM_PATH:-$HOME/models/Qwen2.5-Math-PRM-7B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GSM8K settings, with REINFORCE++ (no critic, no group needed) ---
    algorithm.adv_estimator=reinforce_plus_plus
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
    trainer.experiment_name=qwen2.5-3b_prm_steps_rpp
    trainer.n_gpus_per_node=6
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: an outcome RM and a process RM, each on its own 1-GPU pool; verl's naive manager ---
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
    +async_rm.models.prm.model_path="$PRM_PATH"
    +async_rm.models.prm.n_gpus_per_node=1
    +async_rm.models.prm.weight=0.1
    +async_rm.models.prm.trust_remote_code=True
    +async_rm.models.prm.reward_kind=process
    +async_rm.models.prm.step_separator="'<extra_0>'"  # quoted for Hydra: < and > are not plain-value characters
    +async_rm.models.prm.process_reduction=none  # token-level: needs a per-token estimator (header)
    +async_rm.models.prm.max_length=4096
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
