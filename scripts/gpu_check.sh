#!/usr/bin/env bash
# The one command for a lent GPU machine (one H100/H200, torch + transformers, no Ray/verl/vLLM, no network):
#
#   here:  bash ../shared/tools/gpu/make_kit.sh .whl          (the wheels it lacks; .whl/ is git-ignored)
#   there: bash scripts/gpu_check.sh                          (device tool: carry [".whl"], timeout_s >= budget + 60)
#
# Installs the kit if .whl/ is here and verl is not, then runs the stages of scripts/gpu_check.py within GPU_CHECK_BUDGET_S seconds
# (default 420), most important first: verl's platform with the plugin loaded, `bench rm` on the Llama-3.1-8B shape
# (fresh and steady vs the dense bound, GRPO shared prompts), tests/gpu/test_rm_gpu.py (every CUDA path of the scorer,
# sharded replica, Ray worker group with use_gpu=True, logits judge), tests/gpu/test_colocation_gpu.py (share slowdown,
# sleep and wake of an 8B-shaped RM), `bench rm` on the Qwen2.5-0.5B shape. Figures:
# $OUT/gpu_check.json (rewritten after each stage), bench_rm_*/bench_rm.json, colocation_gpu.json, junit XML; the log:
# $OUT/gpu_check.log. $OUT defaults to out/gpu_check. Without CUDA it rehearses: tiny shapes on the CPU, tests/gpu skip.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/out/gpu_check}"
export OUT
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
PY="${PYTHON:-python3}"
if [ -d .whl ] && ! "$PY" -c 'import verl' 2>/dev/null; then  # the GPU machine: no verl until the kit is in
  . .whl/install_kit.sh || exit 1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export VERL_ASYNC_RM_CACHE="${VERL_ASYNC_RM_CACHE:-/tmp/verl_async_rm_cache}"
command -v nvidia-smi >/dev/null && nvidia-smi || true
"$PY" scripts/gpu_check.py
