#!/usr/bin/env bash
# GRPO on GSM8K over two 8-GPU nodes with the RM on the policy's GPUs: the policy on 8 + 8 GPUs and an RM replica
# beside it on each, asleep while the policy trains (verl-async-rm).
#
# What it trains
#   Policy Qwen/Qwen2.5-3B-Instruct, GRPO (5 samples per prompt), reward = the score of the sequence-classification RM
#   Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 (LlamaForSequenceClassification, one output), scored per trajectory the
#   moment its agent loop ends. The RM has its own chat template (Llama 3), so responses are re-rendered for it.
#
# Prerequisites
#   GPUs     2 nodes x 8 GPUs with 80 GB each (A100/H100), all 16 for the policy (actor + vLLM rollout + reference)
#            and 16 RM replicas beside it, one per GPU (a bf16 copy of the 8B RM, about 15 GB, in the room the
#            rollout's gpu_memory_utilization=0.5 leaves). Modelled faster than a pool of its own on several nodes too
#            (docs/benchmarks.md, bench layout); an RM that cannot sit there takes a pool of its own instead, about one
#            GPU in eight (reward.reward_model.enable_resource_pool=True, n_gpus_per_node=1, nnodes=2, and
#            trainer.n_gpus_per_node=7 with batch sizes that split over 14 GPUs).
#   Cluster  one Ray cluster over both nodes, started before the launch:
#              node 1:  ray start --head --port=6379
#              node 2:  ray start --address=<node-1-ip>:6379
#            then run the script on node 1 (verl's ray.init() joins the running cluster).
#   Install  On both nodes: pip install "verl[vllm]==0.9.1" /path/to/checkout (this package, not on PyPI).
#   Models   local directories on BOTH nodes, same path (or shared storage): the RM replicas load the RM and the
#            policy's tokenizer from disk, not from the Hub:
#              hf download Qwen/Qwen2.5-3B-Instruct --local-dir $HOME/models/Qwen2.5-3B-Instruct
#              hf download Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 \
#                  --local-dir $HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2
#            check: grep -A1 architectures $HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2/config.json
#                   prints "LlamaForSequenceClassification"
#   Data     verl's GSM8K preprocessing (a verl v0.9.1 checkout), on both nodes at the same path (or shared
#            storage): writes train.parquet and test.parquet
#              python3 examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
#
# Launch
#   bash recipes/grpo_gsm8k_2nodes.sh [more Hydra overrides, e.g. trainer.total_epochs=1]
#   Paths come from POLICY_PATH, RM_PATH and DATA_DIR (defaults below).
set -euo pipefail

POLICY_PATH=${POLICY_PATH:-$HOME/models/Qwen2.5-3B-Instruct}
RM_PATH=${RM_PATH:-$HOME/models/Skywork-Reward-Llama-3.1-8B-v0.2}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

overrides=(
    # --- verl's usual GRPO-on-GSM8K settings ---
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=512
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    data.return_raw_chat=True
    actor_rollout_ref.model.path="$POLICY_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=128
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger='["console","wandb"]'
    trainer.project_name=verl_async_rm_gsm8k
    trainer.experiment_name=qwen2.5-3b_skywork-rm-8b_2nodes
    trainer.n_gpus_per_node=8
    trainer.nnodes=2
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
    # --- verl-async-rm: an RM replica on each of the policy's 16 GPUs, asleep during the update ---
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager
    reward.reward_model.enable_resource_pool=False
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
