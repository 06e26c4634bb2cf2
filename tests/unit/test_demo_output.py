"""The demo's JSON summary, table, PNG timeline, config checks and CLI options (no Ray)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from verl_async_rm.demo.options import DemoConfig
from verl_async_rm.demo.summary import SUMMARY_KEYS, build_summary, environment, format_table, write_summary
from verl_async_rm.demo.timeline import MODE_KEYS, BatchRecord, StepTimeline

pytestmark = pytest.mark.unit


def _step(mode, tail, replicas=2):
    t0 = 100.0
    finishes = [t0 + 0.5, t0 + 1.0, t0 + 3.0]
    batches = [BatchRecord(0, t0 + 0.6, t0 + 0.9, 1), BatchRecord(1, t0 + 3.0, t0 + 3.0 + tail, 2)]
    return StepTimeline(mode=mode, step=1, t0=t0, t_end=t0 + 3.0 + tail + 0.01, finishes=finishes, batches=batches,
                        num_replicas=replicas, rewards=[1.0, 2.0, math.nan], rm_scores=[1.0, 2.0, 3.0],
                        rule_scores=[0.0, 0.0, 0.0])


def _summary():
    modes = {"async": [_step("async", 0.2)], "sync": [_step("sync", 2.0)]}
    return modes, build_summary(modes, config=DemoConfig().to_dict(), env=environment(), wall_s=12.5,
                                files={"timeline_png": "t.png"}, ray_info={"left_behind": []})


def test_summary_has_stable_keys_and_the_speedup():
    _, summary = _summary()
    assert tuple(summary) == SUMMARY_KEYS
    for name in ("async", "sync"):
        assert set(MODE_KEYS) | {"per_step"} == set(summary["modes"][name])
    expected = (3.0 + 2.0 + 0.01) / (3.0 + 0.2 + 0.01)
    assert summary["speedup"] == pytest.approx(expected)
    for key in ("verl_async_rm", "verl", "ray", "torch", "python", "cpu_count"):
        assert key in summary["environment"]
    assert summary["environment"]["verl"] is not None  # verl is installed where the tests run


def test_written_json_turns_nan_into_null(tmp_path):
    _, summary = _summary()
    path = write_summary(summary, tmp_path / "summary.json")
    with open(path) as f:
        loaded = json.loads(f.read())  # strict JSON: no NaN literal
    assert loaded["modes"]["async"]["per_step"][0]["rewards"] == [1.0, 2.0, None]
    assert loaded["modes"]["sync"]["reward_tail_s"] == pytest.approx(2.0)


def test_table_has_a_row_per_mode_and_the_speedup():
    _, summary = _summary()
    table = format_table(summary)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["mode", "steps"]
    assert lines[1].split()[0] == "async" and lines[2].split()[0] == "sync"
    assert "0.20" in lines[1] and "2.00" in lines[2]
    assert f"{summary['speedup']:.2f}x" in lines[-1]


def test_plot_writes_a_png_with_both_modes(tmp_path):
    from verl_async_rm.demo.plot import plot_timeline

    modes, _ = _summary()
    path = plot_timeline(modes, tmp_path / "timeline.png")
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="at least one mode"):
        plot_timeline({}, tmp_path / "empty.png")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, "steps=0"),
        ({"batch_size": 1.5}, "batch_size=1.5"),
        ({"rm_hidden_size": 100}, "multiple of 64"),
        ({"decode_s_per_token": -1.0}, "decode_s_per_token"),
        ({"median_tokens": math.inf}, "median_tokens"),
        ({"rm_weight": 0.0, "rule_weight": 0.0}, "both 0"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kwargs)


def test_cli_options_fill_the_config():
    from verl_async_rm.cli import build_parser

    args = build_parser().parse_args(["demo", "--steps", "1", "--batch-size", "8", "--out", "x", "--no-progress",
                                      "--decode-s-per-token", "0.01"])
    from verl_async_rm.demo.cli import config_from_args

    config = config_from_args(args)
    assert (config.steps, config.batch_size, config.out_dir, config.progress) == (1, 8, "x", False)
    assert config.decode_s_per_token == 0.01 and config.rm_replicas == DemoConfig().rm_replicas
    assert isinstance(args, argparse.Namespace)


def test_summary_config_names_the_v1_trainer_and_its_polling_period():
    from verl_async_rm.demo.cli import report
    from verl_async_rm.demo.modes import POLL_INTERVAL_S
    from verl_async_rm.demo.run import DemoResult, summary_config

    config = summary_config(DemoConfig(steps=2))
    assert config["trainer"] == "v1" and config["replay_buffer_poll_interval_s"] == POLL_INTERVAL_S
    assert {k: config[k] for k in DemoConfig().to_dict()} == DemoConfig(steps=2).to_dict()
    modes, _ = _summary()
    summary = build_summary(modes, config=config, env=environment(), wall_s=1.0, files={},
                            ray_info={"left_behind": []})
    result = DemoResult(out_dir=Path("o"), summary_path=Path("o/s.json"), timeline_path=Path("o/t.png"),
                        summary=summary)
    assert f"verl v1 trainer, replay buffer polling TransferQueue every {POLL_INTERVAL_S:g} s in every mode" in (
        report(result).splitlines())


def test_both_modes_get_the_same_questions_under_their_own_uids():
    from verl_async_rm.demo.workload import prompt_uids, prompts_batch

    a, s = prompts_batch(3, 4, mode="async"), prompts_batch(3, 4, mode="sync")
    assert list(a["raw_prompt"]) == list(s["raw_prompt"]) and len(a) == 4
    assert list(a["uid"]) == prompt_uids(3, 4, mode="async") == [f"async-step3-{i}" for i in range(4)]
    assert not set(a["uid"]) & set(s["uid"]) and not any("_" in u for u in a["uid"])
    assert list(a["index"].tolist()) == [0, 1, 2, 3] and list(a["reward_model"])[0] == {"ground_truth": "42"}
    assert list(prompts_batch(4, 4, mode="async")["raw_prompt"]) != list(a["raw_prompt"])  # a new step, new prompts
    with pytest.raises(ValueError, match="may not contain '_'"):
        prompt_uids(1, 2, mode="my_mode")


def _tq_rows(policy_tok):
    """Two trajectories as verl's v1 agent-loop worker puts them in TransferQueue (unpadded, different lengths)."""
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    def row(question, answer):
        prompt = policy_tok(question)["input_ids"]
        response = policy_tok(answer, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
        return {"prompts": torch.tensor(prompt), "responses": torch.tensor(response),
                "raw_prompt": [{"role": "user", "content": question}], "data_source": "demo",
                "reward_model": {"ground_truth": "42"}}

    return list_of_dict_to_tensordict([row("first question, a long one", "the answer is 42"), row("second", "no")])


def test_sync_requests_are_the_unpadded_trajectories_in_the_given_order(policy_tok):
    from verl_async_rm.demo.modes import requests_from_batch

    data = _tq_rows(policy_tok)
    requests = requests_from_batch(data, [1, 0], ["k1_0_0", "k0_0_0"])
    assert [r.uid for r in requests] == ["k0_0_0", "k1_0_0"]
    assert requests[0].prompt_ids == data["prompts"][1].tolist()
    assert requests[1].response_ids == data["responses"][0].tolist()
    assert len(requests[1].prompt_ids) != len(requests[0].prompt_ids)  # no padding to a common width
    assert requests[1].raw_prompt == [{"role": "user", "content": "first question, a long one"}]
    assert [r.group for r in requests] == ["k0", "k1"]  # verl's prompt uid: a GRPO group, as the workers set it


def test_sync_rule_score_is_the_rule_on_the_decoded_response(policy_tok):
    from verl_async_rm.demo import rule
    from verl_async_rm.demo.modes import rule_scorer

    data = _tq_rows(policy_tok)
    score = rule_scorer(policy_tok)
    assert score(data, 0) == pytest.approx(rule.compute_score("demo", "the answer is 42", "42")["score"])
    assert score(data, 0) > 1.0 > score(data, 1)  # the ground truth found in the first response only
    assert score(data, 1) == pytest.approx(0.5 * (1 - 2 / 1000))  # "no": the eos token is not part of the text


def test_the_demo_loops_refuse_to_refill_failed_groups():
    """A refill would put other prompts into one mode's step: the demo stops instead, saying why."""
    from verl_async_rm.demo.modes import _no_refill

    with pytest.raises(RuntimeError, match="2 prompt group\\(s\\) of the demo step failed"):
        _no_refill(2)
