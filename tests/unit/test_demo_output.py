"""The demo's figures from what verl logs: each step's phases and RM score, the steady means, the RM's overhead
against the no-RM run, the printed report and the figure. Rows in the shape verl's file logger and the demo's replay
buffer write them; no Ray, no verl run."""

from __future__ import annotations

import json

import pytest

from verl_async_rm.demo.options import DemoConfig
from verl_async_rm.demo.run import ModeRun
from verl_async_rm.demo.summary import PHASES, SUMMARY_KEYS, build_summary, format_report, overhead, step_record

pytestmark = pytest.mark.unit

TRAJ = 4


def _metrics(step: int, *, rollout: float, tail: float, score: float, extra: float = 0.0) -> dict:
    """One row of verl's file logger: ``{"step": k, "data": {...}}``."""
    data = {"training/global_step": step, "timing_s/step": rollout + tail + 0.3 + 0.4 + 0.05 + 0.1 + extra,
            "demo/rollout_s": rollout, "demo/reward_tail_s": tail, "timing_s/old_log_prob": 0.2, "timing_s/ref": 0.1,
            "timing_s/adv": 0.02, "timing_s/update_actor": 0.38, "timing_s/update_weights": 0.05,
            "critic/score/mean": score}
    return {"step": step, "data": data}


def _trajectories(step: int, scores: list[float | None]) -> list[dict]:
    return [{"step": step, "key": f"u{i}_{i % 2}_0", "reward": s if s is not None else 0.5,
             "reward_extra_info": {} if s is None else {"rm_score": s, "rule_score": 0.0}, "response_tokens": 10 + i,
             "digest": f"d{step}{i}"} for i, s in enumerate(scores)]


def _run(mode: str, extra: float, rm: bool) -> ModeRun:
    metrics, trajectories = [], []
    for step in (1, 2, 3):
        scores = [1.0 + 0.5 * step + 0.1 * i for i in range(TRAJ)] if rm else [None] * TRAJ
        metrics.append(_metrics(step, rollout=1.0 + (2.0 if step == 1 else 0.0), tail=0.2 if rm else 0.05,
                                score=1.0, extra=extra))
        trajectories += _trajectories(step, scores)
    return ModeRun(mode=mode, metrics=metrics, trajectories=trajectories, wall_s=100.0, left_behind=[])


@pytest.fixture
def summary():
    runs = {"plugin": _run("plugin", 0.1, rm=True), "no_rm": _run("no_rm", 0.0, rm=False)}
    return build_summary(DemoConfig(modes="plugin,no_rm", steps=3), runs, env={"cpu_count": 2}, wall_s=250.0,
                         setup_s=10.0, files={})


def test_a_step_is_split_into_its_phases_and_they_add_up():
    record = step_record(_metrics(2, rollout=1.0, tail=0.2, score=3.0)["data"], _trajectories(2, [1.0, 3.0]),
                         "plugin")
    assert record["step"] == 2 and record["rollout_s"] == 1.0 and record["reward_tail_s"] == 0.2
    assert record["log_prob_s"] == pytest.approx(0.3) and record["update_s"] == pytest.approx(0.4)
    assert record["weight_sync_s"] == 0.05 and record["other_s"] == pytest.approx(0.1)
    assert sum(record[f"{p}_s"] for p in PHASES) == pytest.approx(record["step_s"])
    assert record["mean_rm_score"] == 2.0 and record["rm_scores"] == [1.0, 3.0] and record["trajectories"] == 2


def test_without_an_rm_there_is_no_rm_score():
    record = step_record(_metrics(1, rollout=1.0, tail=0.0, score=0.5)["data"], _trajectories(1, [None, None]),
                         "no_rm")
    assert record["mean_rm_score"] is None and record["rm_scores"] == [None, None] and record["rewards"] == [0.5, 0.5]


def test_the_summary_keeps_every_trajectory_and_averages_the_steady_steps(summary):
    assert tuple(summary) == SUMMARY_KEYS
    plugin = summary["modes"]["plugin"]
    assert plugin["steady_steps"] == [2, 3]  # step 1 starts vLLM's engine
    assert plugin["rollout_s"] == pytest.approx(1.0) and plugin["reward_tail_s"] == pytest.approx(0.2)
    assert [len(s["rm_scores"]) for s in plugin["per_step"]] == [TRAJ] * 3
    assert plugin["rm_score_first"] == pytest.approx(1.65) and plugin["rm_score_gain"] == pytest.approx(1.0)
    json.dumps(summary)  # summary.json


def test_the_rm_overhead_is_the_step_time_above_the_no_rm_run(summary):
    over = summary["overhead_vs_no_rm"]
    assert set(over) == {"plugin"}
    assert over["plugin"]["per_step_s"] == {2: pytest.approx(0.25), 3: pytest.approx(0.25)}  # tail 0.15 + other 0.1
    assert over["plugin"]["mean_s"] == pytest.approx(0.25)
    assert over["plugin"]["share"] == pytest.approx(0.25 / summary["modes"]["no_rm"]["step_s"])
    assert overhead({"plugin": summary["modes"]["plugin"]}) == {}  # no floor without a no-RM run


def test_the_report_prints_the_mode_table_the_scores_per_step_and_every_steps_split(summary):
    report = format_report(summary)
    lines = report.splitlines()
    assert "reward tail" in lines[1] and "RM overhead" in lines[1]
    assert lines[2].startswith("plugin, own pool") and lines[2].rstrip().endswith("+0.25 (+13%)")  # of 1.90 s
    assert lines[3].startswith("no RM (rule)") and lines[3].rstrip().endswith("-")
    assert "plugin, own pool: RM score 1.65 at step 1 -> 2.65 at step 3 (+1.00)" in report
    assert sum(line.startswith("  step ") for line in lines) == 6 and "overhead +0.25" in report


def test_the_figure_is_a_png(summary, tmp_path):
    from verl_async_rm.demo.plot import plot_training

    path = plot_training(summary, tmp_path / "curve.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
