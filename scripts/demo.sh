#!/usr/bin/env bash
# README command 1: the CPU demo. The same rollout steps run through verl's real agent loop twice: with the plugin
# (each trajectory scored by the RM the moment its agent loop ends) and the synchronous way (the whole batch scored
# after the rollout). Prints a table per mode and the speed-up; writes timeline.png and summary.json. Options:
# `verl-async-rm demo --help` (e.g. --steps, --batch-size, --out DIR, --seed).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec verl-async-rm demo "$@"
