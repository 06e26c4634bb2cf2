"""``verl-async-rm demo --modes plugin`` end to end, as a user runs it (a subprocess: a ``python -m
verl.trainer.main_ppo`` run with its own Ray cluster): the plugin on its own pool, 6 GRPO steps on verl's own v1
trainer. The policy raises the RM score, every trajectory is scored, the step time is split into phases, and nothing
of the run's Ray cluster is left.

The README's command runs 8 steps and the run with no RM beside it (``--modes plugin,no_rm``); CI runs the plugin's
mode only (a run of verl's trainer costs this 2-core machine minutes): the RM overhead against the no-RM run is
computed and printed from two modes' summaries in ``tests/unit/test_demo_output.py``, each mode's command is checked
in ``tests/unit/test_demo_modes.py``, and the full comparison (``--modes all``: verl's served RM and the plugin on the
policy's GPU too) is run by hand for the README (the plugin on the policy's GPUs in verl's trainer:
``test_manager_v1.py``).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from conftest import REPO_ROOT, require_vllm
from program_runs import Command

pytestmark = pytest.mark.integration

STEPS, PROMPTS, N = 6, 8, 4


def program_command(request) -> Command:
    """The README's demo command (6 steps instead of 8, the plugin's mode alone), run in a folder of its own
    (:mod:`program_runs`: the session starts it beside the unit tier)."""
    tiny_models = request.getfixturevalue("tiny_models")
    cwd = request.getfixturevalue("tmp_path_factory").mktemp("demo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    # no --out: the README's command writes to ./async_rm_demo/<time>, a relative folder verl's workers must find
    return Command([sys.executable, "-m", "verl_async_rm", "demo", "--modes", "plugin", "--steps", str(STEPS),
                    "--cache-dir",
                    str(tiny_models.root.parent), "--no-progress"], cwd=cwd, env=env, timeout_s=840)


@pytest.fixture(scope="module")
def demo_run(request, program_runs):
    require_vllm()
    proc = program_runs.finish(__name__, lambda: program_command(request))
    assert proc.returncode == 0, proc.stderr[-4000:]
    [out] = (proc.command.cwd / "async_rm_demo").iterdir()
    return out, proc.stdout, json.loads((out / "summary.json").read_text())


def test_the_policy_raises_the_rm_score_and_the_demo_prints_it(demo_run):
    _, stdout, summary = demo_run
    plugin = summary["modes"]["plugin"]
    scores = [s["mean_rm_score"] for s in plugin["per_step"]]
    assert len(scores) == STEPS and scores[-1] > scores[0], scores
    assert f"plugin, own pool: RM score {scores[0]:.2f} at step 1 -> {scores[-1]:.2f} at step {STEPS}" in stdout
    assert "mean RM score per step" in stdout


def test_every_trajectory_of_every_step_is_kept_and_scored(demo_run):
    _, _, summary = demo_run
    assert list(summary["modes"]) == ["plugin"]
    mode = summary["modes"]["plugin"]
    assert [s["step"] for s in mode["per_step"]] == list(range(1, STEPS + 1))
    for s in mode["per_step"]:
        assert s["trajectories"] == PROMPTS * N and len(s["rewards"]) == PROMPTS * N
        assert s["plugin_scored"] == PROMPTS * N and s["plugin_errors"] == 0
        assert all(math.isfinite(r) for r in s["rm_scores"]) and s["rewards"] == pytest.approx(s["rm_scores"])
    lengths = {n for s in summary["modes"]["plugin"]["per_step"] for n in s["response_tokens"]}
    assert len(lengths) > 3  # the heavy-tailed lengths of the demo's agent loop


def test_each_step_is_split_into_phases(demo_run):
    from verl_async_rm.demo.summary import PHASES, SUMMARY_KEYS

    out, stdout, summary = demo_run
    assert tuple(summary) == SUMMARY_KEYS
    for mode in summary["modes"].values():
        for s in mode["per_step"]:
            assert all(s[f"{p}_s"] >= 0 for p in PHASES) and s["rollout_s"] > 0 and s["update_s"] > 0
            assert sum(s[f"{p}_s"] for p in PHASES) == pytest.approx(s["step_s"], rel=1e-6)
    assert summary["overhead_vs_no_rm"] == {}  # no no-RM run to compare with
    assert "reward tail" in stdout and "weight sync" in stdout
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_process_of_the_runs_ray_clusters_is_left(demo_run):
    _, stdout, summary = demo_run
    assert all(mode["ray_left_behind"] == [] for mode in summary["modes"].values())
    assert "no process left" in stdout
    import psutil

    leftovers = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
                 if any(arg.startswith("/tmp/vard") for arg in (p.info["cmdline"] or []))]
    assert leftovers == []
