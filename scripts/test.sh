#!/usr/bin/env bash
# Runs the test suite (unit + integration; gpu tests are skipped without CUDA). Extra args go to pytest, in one
# process.
#
# With no args (the README's command, CI) it runs the suite in two pytest processes at once, because it is CPU-bound
# and neither part keeps a 2-core machine busy alone (tests/conftest.py, --part, ORDER): the modules on the session's
# ray_local cluster, and beside them the rest (the unit tier, one core; the modules with a Ray cluster of their own;
# the demo's and the recipe's runs; then the ray_wide and vllm_ray modules, and those with no cluster). The second
# part's output is printed after the first's; it fails if either fails.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
if [ $# -gt 0 ]; then
  exec python -m pytest "$@"
fi

LOG="$(mktemp -t verl_async_rm_tests.XXXXXX)"
python -m pytest --part own -o cache_dir=.pytest_cache/own >"$LOG" 2>&1 &
own=$!
trap 'kill -INT "$own" 2>/dev/null; wait "$own"' INT TERM
echo "== the modules on the session's ray_local cluster (the rest run beside; their output follows) =="
set +e
python -m pytest --part shared
shared=$?
wait "$own"
own_rc=$?
set -e
echo
echo "== the rest: unit tier, own clusters, program runs, ray_wide, vllm_ray, no cluster (ran beside; log: $LOG) =="
cat "$LOG"
echo "== pytest exit codes: ray_local $shared, the rest $own_rc =="
[ "$shared" -eq 0 ] && [ "$own_rc" -eq 0 ]
