#!/usr/bin/env bash
# Runs the test suite (unit + integration; gpu tests are skipped without CUDA). Extra args go to pytest, in one
# process.
#
# With no args (the README's command, CI) it runs two pytest processes at once, because the suite is CPU-bound and
# neither keeps a 2-core machine busy alone: the unit tier (one process, one core) with the two modules that read a
# whole program's output (the demo's and the recipe's runs, started with that session) beside the integration and
# gpu tiers, whose Ray clusters leave a core idle a fifth of the time. The second one's output follows the first's.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
if [ $# -gt 0 ]; then
  exec python -m pytest "$@"
fi

BESIDE=(tests/unit tests/integration/test_demo.py tests/integration/test_cpu_recipe.py)
LOG="$(mktemp -t verl_async_rm_tests.XXXXXX)"
python -m pytest -o cache_dir=.pytest_cache/beside "${BESIDE[@]}" >"$LOG" 2>&1 &
beside=$!
trap 'kill -INT "$beside" 2>/dev/null; wait "$beside"' INT TERM
echo "== integration and gpu tiers (the unit tier and the program runs run beside; their output follows) =="
set +e
python -m pytest tests/integration tests/gpu --ignore=tests/integration/test_demo.py \
  --ignore=tests/integration/test_cpu_recipe.py
main=$?
wait "$beside"
side=$?
set -e
echo
echo "== unit tier, the demo's and the recipe's runs (ran beside the above; log: $LOG) =="
cat "$LOG"
echo "== pytest exit codes: integration and gpu $main, unit and program runs $side =="
[ "$main" -eq 0 ] && [ "$side" -eq 0 ]
