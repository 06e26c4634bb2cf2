#!/usr/bin/env bash
# README command 1: the CPU demo. GRPO with verl's own trainer (python -m verl.trainer.main_ppo) on this CPU machine,
# once with the plugin scoring every trajectory the moment its agent loop ends and once with no RM (the floor on step
# time); --modes all adds verl's own served RM and the plugin on the policy's GPU. Prints the time per step split into
# phases, the RM's overhead against the no-RM run and the mean RM score per step; writes reward_curve.png and
# summary.json. Options: `verl-async-rm demo --help` (e.g. --modes, --steps, --out DIR, --seed).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec verl-async-rm demo "$@"
