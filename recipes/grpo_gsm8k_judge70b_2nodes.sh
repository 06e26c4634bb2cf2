#!/usr/bin/env bash
# GRPO on GSM8K with a 72B judge that writes a 0-10 verdict next to verl's GSM8K rule: two 8-GPU nodes, the 32B
# policy on 4+4 GPUs, the judge on the other 4+4 as two replicas, each one vLLM engine tensor parallel over 4 GPUs.
#
# Layout
#   a pool of its own: a judge that writes runs vLLM, which is not put to sleep on the policy's GPUs.
#
# What it trains
#   Policy Qwen/Qwen2.5-32B-Instruct, GRPO (5 samples per prompt), reward per trajectory =
#       rule_weight * (naive manager's reward) + rm_weight * judge verdict
#     = 1.0 * GSM8K rule (0 or 1) + 0.05 * Qwen2.5-72B-Instruct's grade (0 to 10)
#   Reward manager: verl's `naive` (rule_weight defaults to 1.0 with a manager of verl's). Its rule is verl's
#   default_compute_score for data_source "openai/gsm8k": 1.0 when the number after "####" equals the ground truth.
#   Judge (the pool's RM, reward.reward_model.*): Qwen/Qwen2.5-72B-Instruct (Qwen2ForCausalLM, about 145 GB of bf16
#   weights: more than one 80 GB GPU holds) with reward_kind=judge and judge_readout=generate: the default prompt
#   (question, response, the dataset's ground truth) asks for a grade from 0 to 10 ending "Verdict: <n>", greedy, at
#   most judge_max_tokens=256; the last "Verdict: <n>" is the score, and a verdict that does not parse fails its
#   trajectory (counted in async_rm/judge_parse_failures), never a default score. gpus_per_replica=4: each replica is
#   one vLLM engine with tensor_parallel_size=4 over its 4 GPUs (36 GB of weights per GPU); a rank that dies ends its
#   replica, which is replaced whole. The outcome RM of the other recipes (Skywork/Skywork-Reward-Llama-3.1-8B-v0.2,
#   LlamaForSequenceClassification) is replaced by the judge here: add it as +async_rm.models.rm.* if GPUs are left.
#   Verdict scale: a 0-10 grade next to a 0/1 rule. rm_weight=0.05 puts a perfect grade (0.5) at half a correct
#   answer, so the rule leads and the judge ranks within a GRPO group (GRPO normalises each group's rewards, so only
#   the spread within a group counts: a grade that moves 2 points moves the reward 0.1). With rm_weight=1.0 the grade
#   (0-10) would drown the rule; to weigh them alike, use rm_weight=0.1 (a perfect grade = one correct answer).
#   Logged per sample in reward_extra_info: rm_score and rm_score_main (the verdict), rm_verdict_main (the last 300
#   characters of the judge's text), rm_total, rule_score; per step: async_rm/* (async_rm/judge_tokens and
#   async_rm/judge_parse_failures among them: the judge is the only RM, so its figures carry no name).
#
# Prerequisites
#   GPUs     2 nodes x 8 GPUs with 80 GB each (A100/H100). On each node: 4 for the policy (8 in all: actor + vLLM
#            rollout with tensor parallel 4 + reference) and 4 for one judge replica. verl's trainer pool takes the same
#            number of GPUs on every node and a replica's GPUs are all on one node, so a policy on 12 GPUs (6+6) would
#            leave 2 per node: too few for a 4-GPU replica (on 141 GB GPUs, gpus_per_replica=2 fits: 6+6 and 2+2).
#   Cluster  one Ray cluster over both nodes, started before the launch:
#              node 1:  ray start --head --port=6379
#              node 2:  ray start --address=<node-1-ip>:6379
#            then run the script on node 1 (verl's ray.init() joins the running cluster).
#   Install  On both nodes: pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI); vLLM runs the judge in its replicas.
#   Models   local directories on BOTH nodes, same path (or shared storage): the replicas load the judge and the
#            policy's tokenizer from disk, not from the Hub:
#              hf download Qwen/Qwen2.5-32B-Instruct --local-dir $HOME/models/Qwen2.5-32B-Instruct
#              hf download Qwen/Qwen2.5-72B-Instruct --local-dir $HOME/models/Qwen2.5-72B-Instruct
#            check: grep -A1 architectures $HOME/models/Qwen2.5-72B-Instruct/config.json prints Qwen2ForCausalLM
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout), on both nodes at the same path (or shared
#            storage): writes train.parquet and test.parquet, with the ground truth the judge reads
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_judge70b_2nodes.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, JUDGE_PATH and DATA_DIR (defaults below).
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-32B-Instruct}
JUDGE_PATH=${JUDGE_PATH:-$HOME/models/Qwen2.5-72B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GRPO-on-GSM8K settings, for a 32B policy on 8 GPUs ---
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
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.tensor_model_parallel_size=4
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger='["console","wandb"]'
    trainer.project_name=verl_async_rm_gsm8k
    trainer.experiment_name=qwen2.5-32b_judge72b_tp4_2nodes
    trainer.n_gpus_per_node=4
    trainer.nnodes=2
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: the judge on its own pool, one 4-GPU tensor-parallel replica on each node ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=True
    reward.reward_model.n_gpus_per_node=4
    reward.reward_model.nnodes=2
    reward.reward_model.model_path="$JUDGE_PATH"
    reward.reward_manager.name=naive
    # reward.custom_reward_function.path stays null: the rule is verl's default_compute_score for the data source
    +async_rm.gpus_per_replica=4
    +async_rm.reward_kind=judge
    +async_rm.judge_readout=generate
    +async_rm.judge_max_tokens=256
    +async_rm.rm_weight=0.05
    +async_rm.max_batch_size=64
    +async_rm.max_wait_ms=20
    +async_rm.max_length=4096
)

cmd=(python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@")
if [[ -n "${VERL_ASYNC_RM_RECIPE_DRY_RUN:-}" ]]; then
    printf '%s\0' "${cmd[@]}"  # the exact command, NUL-separated (read by tests/unit/test_recipes.py)
    exit 0
fi
exec "${cmd[@]}"
