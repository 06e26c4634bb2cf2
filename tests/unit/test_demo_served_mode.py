"""The demo's third mode (verl's served RM) in its figures, its summary and its table; the demo agent loop's lengths;
the plot's third panel (pure code, no Ray)."""

from __future__ import annotations

import pytest

from verl_async_rm.demo.timeline import BatchRecord, StepTimeline, mode_summary

pytestmark = pytest.mark.unit

T0 = 2_000.0


def served(calls=((1.1, 1.4), (1.2, 1.5), (4.1, 4.3)), finishes=(1.0, 1.1, 4.0), t_end=4.4):
    return StepTimeline(mode="verl_served", step=1, t0=T0, t_end=T0 + t_end, finishes=[T0 + t for t in finishes],
                        batches=[], num_replicas=2, rewards=[1.0, 2.0, 3.0], rm_scores=[0.1, 0.2, 0.3],
                        rule_scores=[0.0] * 3, responses=["a", "b", "c"],
                        rm_calls=[(T0 + a, T0 + b) for a, b in calls])


def test_served_step_figures_come_from_its_requests():
    m = served().metrics()
    assert m["reward_tail_s"] == pytest.approx(0.3)  # last request end 4.3 - last finish 4.0
    assert m["rm_busy_s"] == pytest.approx(0.4 + 0.2)  # overlapping requests count once: [1.1, 1.5] + [4.1, 4.3]
    assert m["rm_busy_per_trajectory_ms"] == pytest.approx(1e3 * 0.6 / 3)
    assert m["scored"] == 3 and m["trajectories"] == 3
    assert m["batches"] is None and m["mean_batch_size"] is None and m["rm_utilization"] is None  # inside vLLM
    assert mode_summary([served()])["batches"] is None


def test_the_plugins_busy_time_is_measured_the_same_way():
    s = StepTimeline(mode="async", step=1, t0=T0, t_end=T0 + 3, finishes=[T0 + 1, T0 + 2],
                     batches=[BatchRecord(0, T0 + 1.0, T0 + 1.5, 1), BatchRecord(1, T0 + 1.2, T0 + 1.7, 1)],
                     num_replicas=2)
    assert s.metrics()["rm_busy_s"] == pytest.approx(0.7)  # union of [1.0, 1.5] and [1.2, 1.7]
    assert s.metrics()["rm_utilization"] == pytest.approx(1.0 / (2 * 3))  # replica-seconds, as before


def test_score_agreement_compares_only_the_same_responses():
    from verl_async_rm.demo.summary import score_agreement

    a = served()
    b = served()
    b.rm_scores = [0.1 + 1e-5, 0.9, 0.3]
    b.responses = ["a", "other", "c"]
    agree = score_agreement([a], [b])
    assert agree == {"trajectories": 3, "compared": 2, "max_abs_diff": pytest.approx(1e-5)}
    assert score_agreement([a], [served()])["max_abs_diff"] == 0.0


def test_the_table_has_a_row_per_mode_and_the_served_ratio(tmp_path):
    from verl_async_rm.demo.plot import plot_timeline
    from verl_async_rm.demo.summary import build_summary, format_table

    asy = StepTimeline(mode="async", step=1, t0=T0, t_end=T0 + 2.2, finishes=[T0 + 1, T0 + 1.1, T0 + 2],
                       batches=[BatchRecord(0, T0 + 1.0, T0 + 1.2, 2), BatchRecord(1, T0 + 2.0, T0 + 2.1, 1)],
                       num_replicas=2, rm_scores=[0.1, 0.2, 0.3], responses=["a", "b", "c"])
    modes = {"async": [asy], "verl_served": [served()]}
    summary = build_summary(modes, config={}, env={}, wall_s=1.0, files={}, ray_info={})
    assert summary["agreement"]["async_vs_verl_served"]["compared"] == 3
    table = format_table(summary)
    lines = table.splitlines()
    assert lines[1].split()[0] == "async" and lines[2].split()[0] == "verl_served"
    assert "RM busy/traj (ms)" in lines[0]
    assert f"{4.4 / 2.2:.2f}x" in table and "3/3 same responses" in table and "speed-up" in lines[-1]
    png = plot_timeline(modes, tmp_path / "t.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_demo_agent_loop_draws_a_heavy_tail_that_every_mode_shares():
    from verl_async_rm.demo.agent_loop import response_tokens

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(400)]
    lengths = [response_tokens(p, median_tokens=40, sigma=1.0, seed=0, budget=256) for p in prompts]
    assert lengths == [response_tokens(p, median_tokens=40, sigma=1.0, seed=0, budget=256) for p in prompts]
    assert 30 <= sorted(lengths)[200] <= 52  # the median
    assert max(lengths) >= 5 * 40 and min(lengths) >= 1 and max(lengths) <= 256  # the tail, clipped to the budget
    assert lengths != [response_tokens(p, median_tokens=40, sigma=1.0, seed=1, budget=256) for p in prompts]


def test_the_agent_loop_yaml_names_the_loop_and_its_settings(tmp_path):
    import yaml

    from verl_async_rm.demo.agent_loop import AGENT_NAME, write_agent_loop_config

    entry = yaml.safe_load(write_agent_loop_config(tmp_path / "a.yaml", median_tokens=12, sigma=0.5, seed=7)
                           .read_text())[0]
    assert entry == {"name": AGENT_NAME, "_target_": "verl_async_rm.demo.agent_loop.LogNormalLengthAgentLoop",
                     "median_tokens": 12.0, "sigma": 0.5, "seed": 7}


def test_without_vllm_the_demo_uses_its_stand_in_and_says_why(monkeypatch):
    from verl_async_rm import vllm_cpu
    from verl_async_rm.demo.run import choose_rollout

    monkeypatch.setattr(vllm_cpu, "vllm_unavailable_reason", lambda: "vLLM is not installed: run scripts/env.sh")
    rollout, note = choose_rollout("auto")
    assert rollout == "standin" and "vLLM is not installed" in note and "verl_served mode is skipped" in note
    with pytest.raises(RuntimeError, match="--rollout-backend vllm: vLLM is not installed"):
        choose_rollout("vllm")
    assert choose_rollout("standin")[0] == "standin"
    monkeypatch.setattr(vllm_cpu, "vllm_unavailable_reason", lambda: None)
    assert choose_rollout("auto") == ("vllm", None)


def test_a_bad_rollout_backend_names_the_choices():
    from verl_async_rm.demo.options import DemoConfig

    with pytest.raises(ValueError, match=r"rollout_backend='sglang'.*\('auto', 'vllm', 'standin'\)"):
        DemoConfig(rollout_backend="sglang")
