"""The demo's JSON summary, table, PNG timeline, config checks and CLI options (no Ray)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from verl_async_rm.demo.config import DemoConfig
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
        ({"rm_hidden_size": 100}, "multiple of 8"),
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
