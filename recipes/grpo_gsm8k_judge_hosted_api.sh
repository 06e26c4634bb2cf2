#!/usr/bin/env bash
# GRPO on GSM8K with a hosted OpenAI-compatible API as the judge, next to verl's GSM8K rule: the policy on all 8 GPUs
# of one node, the judge a chat model at a provider, within the account's request and token limits (verl-async-rm).
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * judge verdict
#     = 1.0 * GSM8K rule (0 or 1) + 0.05 * the hosted model's grade (0 to 10)
#   Reward manager: verl's `naive` (rule_weight defaults to 1.0 with a manager of verl's). Its rule is verl's
#   default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground truth.
#   Judge (the main RM, +async_rm.endpoint): JUDGE_MODEL (default gpt-4o-mini) at JUDGE_URL (default OpenAI's
#   https://api.openai.com/v1; any OpenAI-compatible chat API), asked through chat completions at temperature 0 with
#   the default judge prompt (question, response, the dataset's ground truth; "Grade the response from 0 (wrong) to
#   10 (correct). Explain briefly, then end with 'Verdict: <grade>'"), at most judge_max_tokens=256 output tokens;
#   the last "Verdict: <n>" is the score. judge_readout=generate because it needs nothing but chat completions:
#   the logits readout needs top_logprobs (20) of the first token, which not every provider returns. The model must
#   take max_tokens and temperature=0 (some reasoning models refuse them: the start-up check, or every request, then
#   fails with the provider's 400). judge_retries=2: a verdict that does not parse is asked for again, twice at most,
#   before its trajectory fails (async_rm/judge_reasks counts the re-asks); a hosted model does not always write the
#   same text twice, even at temperature 0. Verdict scale: rm_weight=0.05 puts a perfect grade at half a correct
#   answer (the reasoning of recipes/grpo_gsm8k_judge70b_2nodes.sh).
#   The key: +async_rm.api_key_env=JUDGE_API_KEY names the environment variable that holds it; the key itself is in
#   no script, override, log, error or metric, and goes only to JUDGE_URL's host (redirects are not followed).
#   Limits, job-wide (one RM service serves every agent-loop worker): max_rpm=500 and max_tpm=200000, a typical first
#   paid tier for a small model: set your account's numbers (the provider's limits page) or 429s and retries follow.
#   Every attempt counts against max_rpm; each request reserves its prompt (estimated from its length: the model's
#   tokenizer is not at hand) plus 256 output tokens against max_tpm, then the usage the provider reports replaces
#   the reservation. max_concurrency=32 bounds the connections: at 500 requests/min (about 8 a second) and a few
#   seconds each, no more are in flight anyway.
#   Step size for these limits: data.train_batch_size=64 (320 judge requests a step) rather than the 256 of the other
#   recipes. At 500 requests/min 320 take at least 40 s, and at a few hundred tokens each (prompt, response, the
#   judge's reasoning) they use roughly a minute of a 200,000 tokens/min budget: the judge, not the GPUs, then
#   bounds the step time. The validation set (1,319 questions, before training and every test_freq=10 steps) goes to
#   the judge too. With a higher tier raise max_rpm/max_tpm and the batch size together.
#   Logged per sample in reward_extra_info: rm_score and rm_score_main (the verdict), rm_verdict_main (the end of the
#   judge's text), rm_total, rule_score; per step: async_rm/* (async_rm/endpoint_429s, endpoint_tokens_in,
#   endpoint_tokens_out, judge_reasks, judge_parse_failures among them).
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100), all 8 for the policy (actor + vLLM rollout + reference);
#            no GPU for the judge.
#   Account  an API key of an OpenAI-compatible provider, exported on the training node before the launch (never
#            written into this script):
#              export JUDGE_API_KEY=...      # e.g. export JUDGE_API_KEY="$OPENAI_API_KEY"
#            Read by the launch's start-up check and by the judge's RM service, a Ray actor: verl's ray.init() starts
#            Ray from this shell, so its actors see it; a Ray cluster started earlier with `ray start` needs it
#            exported before `ray start`.
#   Install  pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#   Models   the policy, a local directory (its tokenizer decodes the responses the judge reads):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#            the judge is the provider's: the launch checks that JUDGE_URL lists JUDGE_MODEL for your key
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet, with the
#            ground truth the judge reads in reward_model.ground_truth
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_judge_hosted_api.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH and DATA_DIR, the judge from JUDGE_URL and JUDGE_MODEL (defaults below). Before Ray
#   starts, the launch asks the provider for its models (JUDGE_MODEL must be listed) and sends it one chat
#   completion of one token; a missing key, a wrong URL or model stops the launch with a ValueError naming the fix.
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-3B-Instruct}
JUDGE_URL=${JUDGE_URL:-https://api.openai.com/v1}
JUDGE_MODEL=${JUDGE_MODEL:-gpt-4o-mini}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GRPO-on-GSM8K settings, for the policy on 8 GPUs, 64 prompts a step ---
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=64
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    data.return_raw_chat=True
    actor_rollout_ref.model.path="$POLICY_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5
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
    trainer.experiment_name=qwen2.5-3b_judge_hosted_api
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=10
    trainer.total_epochs=15
    # --- verl-async-rm: the judge at a provider's endpoint, within its limits; no replica, no pool ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=False
    reward.reward_manager.name=naive
    # reward.custom_reward_function.path stays null: the rule is verl's default_compute_score for the data source
    +async_rm.endpoint="$JUDGE_URL"
    +async_rm.endpoint_model="$JUDGE_MODEL"
    +async_rm.api_key_env=JUDGE_API_KEY
    +async_rm.reward_kind=judge
    +async_rm.judge_readout=generate
    +async_rm.judge_max_tokens=256
    +async_rm.judge_retries=2
    +async_rm.rm_weight=0.05
    +async_rm.max_rpm=500
    +async_rm.max_tpm=200000
    +async_rm.max_concurrency=32
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
