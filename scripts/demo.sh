#!/usr/bin/env bash
# Runs the main job on this machine. Until the CPU demo lands this is the smoke run: verl loads the plugin, the tiny
# models build, and a prompt goes through verl's real router to a CPU generation server.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec verl-async-rm smoke "$@"
