#!/usr/bin/env bash
# GRPO on GSM8K with a 72B yes/no judge served by vLLM on another node, next to verl's GSM8K rule: the policy on all 8
# GPUs of one node, the judge behind an OpenAI-compatible URL (verl-async-rm).
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * judge
#     = 1.0 * GSM8K rule (0 or 1) + 0.5 * P(Yes) of Qwen2.5-72B-Instruct
#   Reward manager: verl's `naive` (rule_weight defaults to 1.0 with a manager of verl's). Its rule is verl's
#   default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground truth.
#   Judge (the main RM, +async_rm.endpoint): Qwen/Qwen2.5-72B-Instruct served on a second node by vLLM (the command
#   under Models), asked through chat completions: the default judge prompt (question, response, the dataset's ground
#   truth, "Is the response correct? Answer Yes or No.") as the user turn, one output token with top_logprobs=20; the
#   score is the probability of "Yes" renormalised over "Yes" and "No" at that token. If either is not among the 20
#   most likely first tokens, that trajectory fails (never a default score). Why the logits readout, not a written
#   verdict (recipes/grpo_gsm8k_judge70b_2nodes.sh): one output token per trajectory instead of up to
#   judge_max_tokens, so the judge node spends its time on the prompts only, and P(Yes) is a graded score that ranks
#   the responses within a GRPO group. A written 0-10 verdict instead: +async_rm.judge_readout=generate, no
#   judge_tokens, and rm_weight=0.05 (see that recipe's sizing note).
#   No replica and no pool for the judge: reward.reward_model.enable_resource_pool=False (verl's default, written
#   out) leaves every GPU to the policy; with True verl would count a reward pool of reward.reward_model.* GPUs that
#   nothing uses. No reward.reward_model.model_path: the training node needs no copy of the judge (with one, its
#   tokenizer would count each request's tokens, which only max_tpm needs).
#   max_concurrency=128: at most 128 requests in flight from the whole job (one RM service serves every agent-loop
#   worker), so the burst of trajectories that end together waits in the plugin's queue, not as open connections in
#   the server's; raise it towards the server's --max-num-seqs if the server runs fewer requests than that. No
#   max_rpm or max_tpm: the server is yours. A failed request (connection error, 5xx, 429) is retried with backoff
#   within request_timeout_s (1800 s): a server restart shorter than that shows as endpoint_retries, not as failed
#   trajectories.
#   Logged per sample in reward_extra_info: rm_score and rm_score_main (P(Yes)), rm_total, rule_score; per step:
#   async_rm/* (async_rm/endpoint_requests, endpoint_retries, endpoint_latency_ms/p99 among them).
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100) for training, all 8 for the policy (actor + vLLM rollout +
#            reference); a second node with 8 GPUs of 80 GB for the judge server (Qwen2.5-72B-Instruct, about 145 GB
#            of bf16 weights, tensor parallel over 8). The judge node is not part of the Ray cluster: the training
#            node reaches it over HTTP (JUDGE_URL).
#   Network  the training node reaches the judge node's port 8000. Keep that port inside the cluster's network: this
#            server takes no key. To require one, start it with --api-key and export the key on the training node
#            under the name given by +async_rm.api_key_env=JUDGE_API_KEY (vLLM checks it on /v1, all a judge uses).
#   Install  On the training node: pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#            On the judge node: vLLM (pip install vllm, or the same verl[vllm]==0.9.1 environment).
#   Models   On the training node, the policy (its tokenizer decodes the responses the judge reads):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#            On the judge node, the judge and its server (it answers on http://<judge-node>:8000/v1 once loaded):
#              hf download Qwen/Qwen2.5-72B-Instruct --local-dir $HOME/models/Qwen2.5-72B-Instruct
#              vllm serve $HOME/models/Qwen2.5-72B-Instruct --tensor-parallel-size 8 \
#                  --served-model-name judge --port 8000
#            check, from the training node: curl -s $JUDGE_URL/models lists "judge"
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet, with the
#            ground truth the judge reads in reward_model.ground_truth
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   JUDGE_URL=http://<judge-node>:8000/v1 bash recipes/grpo_gsm8k_judge70b_remote.sh [more Hydra overrides]
#   Paths come from POLICY_PATH and DATA_DIR, the judge's base URL from JUDGE_URL (defaults below). Before Ray starts,
#   the launch asks the server for its models (it must list "judge") and sends it one chat completion; a server that
#   is down or serves another model stops the launch with a ValueError naming the URL and the fix.
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-3B-Instruct}
JUDGE_URL=${JUDGE_URL:-http://judge-node:8000/v1}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GRPO-on-GSM8K settings, for the policy on 8 GPUs ---
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
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger='["console","wandb"]'
    trainer.project_name=verl_async_rm_gsm8k
    trainer.experiment_name=qwen2.5-3b_judge72b_remote
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: the judge at an endpoint, scored as each trajectory ends; no replica, no pool ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=False
    reward.reward_manager.name=naive
    # reward.custom_reward_function.path stays null: the rule is verl's default_compute_score for the data source
    +async_rm.endpoint="$JUDGE_URL"
    +async_rm.endpoint_model=judge
    +async_rm.reward_kind=judge
    +async_rm.judge_readout=logits
    +async_rm.judge_tokens='[Yes,No]'
    +async_rm.rm_weight=0.5
    +async_rm.max_concurrency=128
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
