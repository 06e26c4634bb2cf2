#!/usr/bin/env bash
# Runs the test suite (unit + integration; gpu tests are skipped without CUDA). Extra args go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest "$@"
