"""``verl-async-rm demo`` end to end, one step per mode on verl's v1 trainer, as a user runs it (a subprocess with its
own Ray cluster and TransferQueue): on verl's real vLLM rollout, with verl's own served RM as the third mode.

Where vLLM cannot run the demo falls back to its stand-in rollout and two modes; these tests then check those two
(``VERL_ASYNC_RM_REQUIRE_VLLM=1``, set in CI, requires the vLLM run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from verl_async_rm.demo.cluster import alive
from verl_async_rm.demo.summary import SUMMARY_KEYS
from verl_async_rm.demo.timeline import MODE_KEYS, STEP_KEYS

pytestmark = pytest.mark.integration

BATCH = 8


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "verl_async_rm", "demo", "--steps", "1", "--batch-size", str(BATCH),
           "--out", str(out), "--cache-dir", str(tiny_models.root.parent), "--no-progress"]
    if os.environ.get("VERL_ASYNC_RM_REQUIRE_VLLM") == "1":
        cmd += ["--rollout-backend", "vllm"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=840, cwd=str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stdout


def _modes(summary):
    """The modes the run must have: async_vllm and verl_served too when verl's vLLM rollout generated."""
    return {"async", "sync"} | ({"async_vllm", "verl_served"} if summary["config"]["rollout"] == "vllm" else set())


@pytest.mark.timeout(900)
def test_demo_writes_the_png_and_the_json_summary(demo_run):
    out, stdout = demo_run
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert tuple(summary) == SUMMARY_KEYS
    assert set(summary["modes"]) == _modes(summary)
    for name, mode in summary["modes"].items():
        assert set(MODE_KEYS) | {"per_step"} == set(mode), name
        assert mode["steps"] == 1 and len(mode["per_step"]) == 1
        step = mode["per_step"][0]
        assert set(STEP_KEYS) <= set(step)
        assert step["trajectories"] == BATCH and step["scored"] == BATCH  # every trajectory went through the RM once
        assert step["step_time_s"] > 0 and step["reward_tail_s"] is not None and step["rm_busy_per_trajectory_ms"] > 0
        # the plugin's replicas report their batches; verl's served RM batches inside vLLM, out of sight
        assert (step["batches"] is None) if name == "verl_served" else (step["batches"] >= 1)
        assert len(step["rewards"]) == BATCH and all(math.isfinite(r) for r in step["rewards"])
        assert len(step["rm_scores"]) == len(step["responses"]) == BATCH
    sync = summary["modes"]["sync"]["per_step"][0]
    assert sync["batches"] == 2 and {b["size"] for b in sync["timeline"]["batches"]} == {BATCH // 2}  # split in two
    assert summary["modes"]["async"]["per_step"][0]["errors"] == 0
    assert summary["speedup"] > 0
    assert summary["config"]["trainer"] == "v1" and summary["config"]["replay_buffer_poll_interval_s"] > 0
    assert "verl v1 trainer" in stdout
    for key in ("verl_async_rm", "verl", "ray", "torch", "python", "cpu_count"):
        assert summary["environment"][key] is not None
    assert str(out.resolve()) in stdout and "speed-up" in stdout


@pytest.mark.timeout(900)
def test_every_mode_gives_the_same_rewards_for_the_same_responses(demo_run):
    """Same prompts, same lengths, same RM: batching on the fly changes when trajectories are scored, not the score;
    and the plugin scores as verl's own served RM does (fp32).

    Greedy decoding gives each mode the same responses; the scores are compared where the responses' digests agree
    (an engine may in principle break a near-tie differently in another batch), and most of them must. The exact
    per-trajectory comparison on identical inputs is ``test_real_vllm.py``'s.
    """
    out, stdout = demo_run
    summary = json.loads((out / "summary.json").read_text())
    steps = {name: mode["per_step"][0] for name, mode in summary["modes"].items()}
    for other in sorted(_modes(summary) - {"async"}):
        same = [i for i in range(BATCH) if steps["async"]["responses"][i] == steps[other]["responses"][i]]
        assert len(same) >= BATCH // 2, other
        for i in same:
            assert steps["async"]["rewards"][i] == pytest.approx(steps[other]["rewards"][i], abs=1e-3), (other, i)
            assert steps["async"]["rm_scores"][i] == pytest.approx(steps[other]["rm_scores"][i], abs=1e-3), (other, i)
        agreement = summary["agreement"][f"async_vs_{other}"]
        assert agreement["compared"] == len(same) and agreement["max_abs_diff"] <= 1e-3
    assert len({round(r, 3) for r in steps["async"]["rewards"]}) > 1  # the RM tells responses apart
    if "verl_served" in steps:
        assert summary["config"]["rollout"] == "vllm" and summary["environment"]["vllm"]
        assert "the plugin vs verl's served RM" in stdout and "vLLMReplica" in stdout
        # the plugin's replicas on vLLM against verl's served RM (both vLLM pooling engines), where responses agree
        agreement = summary["agreement"]["async_vllm_vs_verl_served"]
        assert agreement["compared"] >= BATCH // 2 and agreement["max_abs_diff"] <= 1e-3
        assert "the plugin on vLLM vs verl's served RM" in stdout and "the plugin's on vLLM:" in stdout


@pytest.mark.timeout(900)
def test_each_mode_ends_its_step_where_its_rewards_are_known(demo_run):
    """async: when verl's replay buffer returns the sample (every reward is in TransferQueue by then); sync: after
    the whole batch was scored, which starts once the sample returned."""
    out, _ = demo_run
    summary = json.loads((out / "summary.json").read_text())
    asy, sync = summary["modes"]["async"]["per_step"][0], summary["modes"]["sync"]["per_step"][0]
    assert asy["step_time_s"] == pytest.approx(asy["sample_s"])
    assert max(b["end_s"] for b in asy["timeline"]["batches"]) <= asy["step_time_s"]  # every RM batch ended before
    assert asy["executor_reward_tail_s"] is not None and asy["executor_rm_utilization"] is not None
    first_sync_batch = min(b["start_s"] for b in sync["timeline"]["batches"])
    assert sync["sample_s"] <= first_sync_batch <= sync["step_time_s"]
    assert max(sync["timeline"]["finishes_s"]) <= sync["sample_s"]  # nothing scored before the whole rollout ended
    on_vllm = summary["modes"].get("async_vllm", {}).get("per_step", [None])[0]
    if on_vllm is not None:  # the plugin on vLLM ends its step as on transformers
        assert on_vllm["step_time_s"] == pytest.approx(on_vllm["sample_s"])
        assert max(b["end_s"] for b in on_vllm["timeline"]["batches"]) <= on_vllm["step_time_s"]
    served = summary["modes"].get("verl_served", {}).get("per_step", [None])[0]
    if served is not None:  # verl's served RM: like async, every reward is known when the sample returns
        assert served["step_time_s"] == pytest.approx(served["sample_s"])
        calls = served["timeline"]["rm_calls"]
        assert len(calls) == BATCH and max(c["end_s"] for c in calls) <= served["step_time_s"]


@pytest.mark.timeout(900)
def test_no_process_of_the_demo_cluster_is_left(demo_run):
    out, _ = demo_run
    ray_info = json.loads((out / "summary.json").read_text())["ray"]
    pids = ray_info["pids"]
    assert len(pids) >= 3  # at least GCS, raylet and a worker were seen
    assert ray_info["left_behind"] == []
    assert [p["pid"] for p in pids if alive(p["pid"], p["create_time"])] == []
    # Independently of the recorded pids: no process names the demo's session dir (GCS, raylet and agents do while
    # they run). Other Ray clusters on the machine have other session dirs.
    import psutil

    session = ray_info["session_dir"]
    assert session and os.path.basename(session).startswith("session_")
    leftovers = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if session in " ".join(proc.info["cmdline"] or []):
            leftovers.append(proc.info["pid"])
    assert leftovers == []
