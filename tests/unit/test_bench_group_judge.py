"""``verl-async-rm bench group-judge`` without vLLM: its workload (the demo's sizes, groups of ``rollout.n`` with their
size on each request, arrivals in order) and its table. The bench itself runs vLLM; its figures are in
``docs/benchmarks.md``."""

from __future__ import annotations

import pytest

from verl_async_rm.bench.group_judge import build_parser, format_table

pytestmark = pytest.mark.unit


def test_the_workload_has_the_demos_sizes_in_groups_that_arrive_in_order(policy_tok):
    from verl_async_rm.bench.group_judge import _steps

    args = build_parser().parse_args(["--steps", "2"])
    steps = _steps(args, policy_tok)
    assert [len(step) for step in steps] == [8 * 4, 8 * 4]
    for step in steps:
        offsets = [offset for offset, _ in step]
        assert offsets == sorted(offsets) and 0.2 < offsets[0] and offsets[-1] < 5.0
        groups = {}
        for _, request in step:
            groups.setdefault(request.group, []).append(request)
            assert request.group_size == 4 and 8 < len(request.response_ids) <= 33 and request.ground_truth
        assert len(groups) == 8 and all(len(g) == 4 for g in groups.values())
    assert _steps(args, policy_tok)[0][0][1].response_ids == steps[0][0][1].response_ids  # seeded


def test_the_table_has_a_row_per_mode():
    row = {"judge_calls_per_trajectory": 0.25, "judge_tokens_in_per_trajectory": 90.9,
           "judge_tokens_out_per_trajectory": 8.25, "reward_wait_s_p50": 0.5, "reward_wait_s_p99": 1.2,
           "step_tail_s_mean": 0.3, "step_tail_s_max": 0.4, "failed": 0, "parse_failures": 0}
    report = {"steps": 3, "prompts": 8, "rollout_n": 4, "max_response": 32,
              "environment": {"cpus": 2, "load_avg_1min": 1.0}, "modes": {"per_response": row, "group": row}}
    lines = format_table(report).splitlines()
    assert len(lines) == 5 and lines[-1].startswith("| group | 0.250 | 90.9 | 8.25 | 0.500 / 1.200 |")
