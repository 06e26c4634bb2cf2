"""`verl-async-rm bench` (the overlap benchmark) on a tiny workload: files written, JSON keys (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from verl_async_rm.bench.report import METRICS
from verl_async_rm.cli import main as cli_main

pytestmark = pytest.mark.unit

TOP_KEYS = {"bound_s", "async_over_bound", "speedup_vs_sync", "predicted_speedup", "lone_latency_s", "clock",
            "policies", "environment", "targets", "params", "rm_model", "workload", "bound"}
POLICY_NAMES = {"sync", "per-request", "eager", "async", "bound"}


def _run(tmp_path, capsys, *extra):
    assert cli_main(["bench", "--trajectories", "48", "--replicas", "2", "--max-batch-size", "8", "--seed", "3",
                     "--out", str(tmp_path), *extra]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "overlap.json").read_text())
    png = (tmp_path / "overlap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert f"output folder: {tmp_path}" in out
    return report, out


def _check_keys(report):
    assert TOP_KEYS <= set(report)
    assert set(report["policies"]) == POLICY_NAMES
    for name, metrics in report["policies"].items():
        assert set(METRICS) <= set(metrics), name
    env = report["environment"]
    for key in ("verl_async_rm", "commit", "verl", "ray", "torch", "python", "cpus"):
        assert key in env
    assert env["verl"] and env["torch"] and env["cpus"] >= 1


def test_virtual_run_writes_files_with_the_keys(tmp_path, capsys):
    report, out = _run(tmp_path, capsys, "--clock", "virtual")
    _check_keys(report)
    assert report["clock"] == "virtual" and report["time_scale"] == 1.0
    p = report["policies"]
    assert report["async_over_bound"] == pytest.approx(p["async"]["step_s"] / report["bound_s"])
    assert report["speedup_vs_sync"] == pytest.approx(p["sync"]["step_s"] / p["async"]["step_s"])
    assert report["params"] == {"trajectories": 48, "replicas": 2, "rm": "sim", "max_batch_size": 8,
                                "max_wait_ms": 20.0, "seed": 3, "rollout_n": 1}
    assert p["sync"]["mean_batch_size"] == 8.0 and p["per-request"]["mean_batch_size"] == 1.0
    assert p["bound"]["step_s"] == report["bound_s"] and p["bound"]["rm_utilization"] is None
    for name in ("sync", "per-request", "eager", "async"):
        assert p[name]["step_s"] >= report["bound_s"] - 1e-9
        assert 0 < p[name]["rm_utilization"] <= 1.0
    assert "async / bound" in out and "per-request" in out


def test_virtual_runs_are_deterministic(tmp_path, capsys):
    a, _ = _run(tmp_path / "a", capsys, "--clock", "virtual")
    b, _ = _run(tmp_path / "b", capsys, "--clock", "virtual")
    assert a["policies"] == b["policies"]


def test_real_clock_run_writes_files_with_the_keys(tmp_path, capsys):
    report, _ = _run(tmp_path, capsys, "--time-scale", "0.005")
    _check_keys(report)
    assert report["clock"] == "real" and report["time_scale"] == 0.005
    assert all(report["policies"][n]["step_s"] > 0 for n in POLICY_NAMES)


def test_your_rm_costs_drive_the_simulated_replicas(tmp_path, capsys):
    report, _ = _run(tmp_path, capsys, "--clock", "virtual", "--rm-batch-ms", "12", "--rm-us-per-token", "5")
    assert report["rm_model"]["a_s"] == pytest.approx(0.012)
    assert report["rm_model"]["b_s_per_token"] == pytest.approx(5e-6)
    assert report["rm_model"]["source"] == "given on the command line"
    # the lone latency is a + b * tokens of the last trajectory, so it lies within the workload's token range
    assert 0.012 < report["lone_latency_s"] <= 0.012 + 5e-6 * report["workload"]["tokens_max"]


@pytest.mark.parametrize("args", [["--replicas", "0"], ["--trajectories", "-1"], ["--clock", "wall"],
                                  ["--time-scale", "0"], ["--rm-batch-ms", "-1"],
                                  ["--rm", "tiny", "--rm-us-per-token", "5"]])
def test_bad_options_exit_with_usage_error(tmp_path, args):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--out", str(tmp_path), *args])
    assert exc.value.code == 2


def test_bench_help_lists_the_benchmarks_not_a_module_docstring(capsys):
    assert cli_main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: verl-async-rm bench") and "--trajectories" in out
    from verl_async_rm.cli import _BENCHES

    assert all(f"bench {name}" in out for name in _BENCHES)
    assert ":mod:" not in out and "``" not in out


def test_the_demo_help_describes_the_training_demo():
    from verl_async_rm.cli import build_parser

    [demo] = [a for a in build_parser()._subparsers._group_actions[0]._choices_actions if a.dest == "demo"]
    assert "main_ppo" in demo.help and "after rollout" not in demo.help
