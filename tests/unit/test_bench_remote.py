"""``verl-async-rm bench remote --quick`` scores the same trajectories on the scripted server with the plugin and with
verl's ``rate_limited`` manager, with no fault and with a fifth of the requests faulted, and writes its JSON. A smoke
test: what each side scored is checked, never how fast."""

from __future__ import annotations

import json

import pytest

from verl_async_rm.cli import main as cli_main

pytestmark = pytest.mark.unit


def test_quick_bench_scores_both_sides_at_both_fault_rates(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERL_ASYNC_RM_CACHE", str(tiny_models.root.parent))  # the tiny policy's tokenizer, built
    assert cli_main(["bench", "remote", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "remote.json").read_text())
    n = report["params"]["trajectories"]
    runs = {(r["side"], r["fault_rate"]): r for r in report["runs"]}
    assert set(runs) == {(side, rate) for side in ("plugin", "verl") for rate in (0.0, 0.2)}
    assert report["reference"]["scored"] == n and report["reference"]["distinct_scores"] > n // 2
    assert report["environment"]["verl"] and report["server"]["server"] == "scripted"
    for run in runs.values():  # both sides asked the server the same questions and got their answers back
        assert run["trajectories"] == n and run["lost"] == 0 and run["asked_as_other_side"]
    assert runs["plugin", 0.0]["equal_to_reference"] == runs["verl", 0.0]["equal_to_reference"] == n

    plugin, verl = runs["plugin", 0.2], runs["verl", 0.2]
    assert plugin["faults_injected"] > 0 and plugin["retries"] == plugin["faults_injected"]
    assert plugin["defaulted"] == 0 and plugin["equal_to_reference"] == n  # nothing lost, nothing defaulted
    assert verl["faults_injected"] > 0 and verl["retries"] == 0  # verl never retries: each fault is a 0.0
    assert verl["defaulted"] == verl["faults_injected"] and verl["equal_to_reference"] == n - verl["defaulted"]
    for run in runs.values():  # a score of 0.0 standing in for a fault is no real score
        assert run["real_scores_per_s"] == pytest.approx(run["equal_to_reference"] / run["wall_s"])
    assert "| plugin | 20% | " in capsys.readouterr().out


def test_quick_outcome_bench_scores_batched_and_one_per_trajectory_alike(tiny_models, tmp_path, monkeypatch):
    """``--kind outcome``: the RM service's batched ``/classify`` against one request per trajectory, on the scripted
    server: every trajectory gets its score both ways, at both fault rates, and batching sends fewer requests."""
    monkeypatch.setenv("VERL_ASYNC_RM_CACHE", str(tiny_models.root.parent))
    assert cli_main(["bench", "remote", "--quick", "--kind", "outcome", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "remote.json").read_text())
    n = report["params"]["trajectories"]
    runs = {(r["side"], r["fault_rate"]): r for r in report["runs"]}
    assert set(runs) == {(side, rate) for side in ("batched", "one per trajectory") for rate in (0.0, 0.2)}
    for run in runs.values():
        assert (run["lost"], run["defaulted"], run["equal_to_reference"]) == (0, 0, n)
    assert runs["one per trajectory", 0.0]["endpoint_requests"] == n
    assert runs["batched", 0.0]["endpoint_requests"] < n // 4
