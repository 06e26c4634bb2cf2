#!/usr/bin/env bash
# GRPO on GSM8K with a 72B pairwise judge served by vLLM on another node, next to verl's GSM8K rule: the policy on
# all 8 GPUs of one node, the judge behind an OpenAI-compatible URL comparing each prompt's 5 responses in pairs, each
# pair in both orders (verl-async-rm).
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * pairwise judge
#     = 1.0 * GSM8K rule (0 or 1) + 0.5 * the response's win rate against its group's others (0 to 1)
#   Reward manager: verl's `naive` (rule_weight defaults to 1.0 with a manager of verl's). Its rule is verl's
#   default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground truth.
#   Pairwise judge (the main RM, +async_rm.endpoint, reward_kind=pairwise_judge, judge_readout=generate):
#   Qwen/Qwen2.5-72B-Instruct served on a second node by vLLM (the command under Models). Each trajectory's request
#   waits until the 5 responses of its prompt have finished; then its 10 pairs are each asked in both orders (20 chat
#   completions per group, sent as the batcher's batches at once), the reply constrained to {"winner": "A"|"B"|"tie"}
#   (response_format; the server enforces it: --structured-outputs-config), at most judge_max_tokens=16. A reply that
#   does not read, or was cut, is asked again twice; a comparison that still fails is left out, and a response with
#   none answered fails alone, never a default. A response's reward is its mean result (win 1, tie 0.5, loss 0) over
#   its comparisons, the two orders averaged (async_rm/position_flip_rate shows the judge's position bias).
#   Logged per sample in reward_extra_info: rm_score and rm_score_main (the win rate), rm_verdict_main, rm_total,
#   rule_score; per step: async_rm/* (comparisons_per_trajectory, position_flip_rate, intransitive_rate, ties,
#   endpoint_* among them).
#
#
# Prerequisites
#   GPUs     1 node x 8 GPUs with 80 GB each (A100/H100) for training, all 8 for the policy (actor + vLLM rollout +
#            reference); a second node with 8 GPUs of 80 GB for the judge server (Qwen2.5-72B-Instruct, about 145 GB
#            of bf16 weights, tensor parallel over 8). The judge node is not part of the Ray cluster: the training
#            node reaches it over HTTP (JUDGE_URL).
#   Network  the training node reaches the judge node's port 8000. Keep that port inside the cluster's network: this
#            server takes no key (to require one: --api-key on the server, and +async_rm.api_key_env=<variable name>
#            here).
#   Install  On the training node: pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#            On the judge node: vLLM.
#   Models   On the training node, the policy (its tokenizer decodes the responses the judge reads):
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#            On the judge node, the judge and its server (it answers on http://<judge-node>:8000/v1 once loaded; a
#            comparison of 2 responses of up to 1024 tokens is about 2.5k tokens):
#              hf download Qwen/Qwen2.5-72B-Instruct --local-dir $HOME/models/Qwen2.5-72B-Instruct
#              vllm serve $HOME/models/Qwen2.5-72B-Instruct --tensor-parallel-size 8 \
#                  --served-model-name judge --port 8000 --max-model-len 16384 --max-num-seqs 64 \
#                  --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'
#            check, from the training node: curl -s $JUDGE_URL/models lists "judge"
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout): writes train.parquet and test.parquet, with the
#            ground truth the judge reads in reward_model.ground_truth
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   JUDGE_URL=http://<judge-node>:8000/v1 bash recipes/grpo_gsm8k_pairwise_judge_remote.sh [more Hydra overrides]
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
    actor_rollout_ref.rollout.val_kwargs.n=2  # a pairwise judge compares a group's responses: two per prompt
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger='["console","wandb"]'
    trainer.project_name=verl_async_rm_gsm8k
    trainer.experiment_name=qwen2.5-3b_pairwise_judge72b_remote
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: the pairwise judge at an endpoint, each pair of a GRPO group in both orders; no pool ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=False
    reward.reward_manager.name=naive
    # reward.custom_reward_function.path stays null: the rule is verl's default_compute_score for the data source
    +async_rm.endpoint="$JUDGE_URL"
    +async_rm.endpoint_model=judge
    +async_rm.reward_kind=pairwise_judge
    +async_rm.judge_readout=generate
    +async_rm.pair_orders=both
    +async_rm.judge_max_tokens=16
    +async_rm.judge_retries=2
    +async_rm.group_wait_s=300
    +async_rm.rm_weight=0.5
    +async_rm.max_concurrency=64
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
