"""Soak: many small steps in a row through the whole v0 integration, then shutdown.

Measured after ``WARMUP`` steps and again after ``STEPS``: the alive Ray actors and the placement groups not REMOVED
(cluster-wide counts), and, for the driver and every actor process the manager set-up started (RM service, RM replicas,
agent-loop workers, verl's reward-loop workers, the generation server), the open file descriptors (``/proc/<pid>/fd``)
and the resident memory (``VmRSS``). At the end the RM service's books must be closed: nothing waiting or running,
``completed == submitted``. After the manager's shutdown no actor started here is alive and every placement group
made here is REMOVED.
"""

from __future__ import annotations

import gc
import math
import os
import time

import pytest
import ray
import torch
from manager_cases import generation, prompts_batch, replicas_of, running_manager

# Imported here, not first inside running_manager: verl modules that fail to import while the integration loads
# (verl/checkpoint_engine/{nccl,hccl}_checkpoint_engine.py without cupy/vllm) leave tracebacks behind that hold the
# importing frames; a first import from running_manager's frame would keep that frame, and the manager in it, alive.
import verl_async_rm.integration.agent_loop_manager  # noqa: F401

pytestmark = pytest.mark.integration

STEPS = int(os.environ.get("VERL_ASYNC_RM_SOAK_STEPS", "200"))  # ~0.1 s a step here; set-up takes ~100 s
WARMUP = 5  # first steps: lazy imports, tokenizer caches, Ray connections and allocator arenas settle here
N_PROMPTS, ROLLOUT_N = 2, 2
PER_STEP = N_PROMPTS * ROLLOUT_N

# Bounds on growth from the end of the warm-up to the end of the soak (STEPS - WARMUP steps). Measured here (2 loaded
# CPU cores): 0 fds in every process, after 45 steps and after 395; RSS at most +1.2 MB after 45 steps and +2.8 MB
# after 395 (the agent-loop workers; +1.4 MB even in verl's load-balancer actor, which only routes: Ray's own drift).
# - alive actors and live placement groups: zero; a step creates none (same pool, replicas, service every step).
MAX_FD_GROWTH = 4  # per process; a per-step fd leak gives >= 195
MAX_RSS_GROWTH_MB = 20.0  # per process, ~7x the drift seen over 395 steps; catches a leak of >= ~100 KB a step
SETTLE_S = 60.0  # ray.kill and placement-group removal return before the cluster has acted


def _alive_actors() -> dict[str, dict]:
    """actor id (hex) -> the GCS record (class name, pid) of every ALIVE actor of the cluster."""
    return ray._private.state.actors(actor_state_name="ALIVE")  # GCS table: works without the dashboard


def _new_actors(before: set[str]) -> dict[str, str]:
    """actor id -> class name of every ALIVE actor that was not alive in ``before``."""
    return {i: a["ActorClassName"] for i, a in _alive_actors().items() if i not in before}


def _live_groups() -> set[str]:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def _proc(pid: int) -> tuple[int, float]:
    """(open fds, RSS in MB) of a process on this machine."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return fds, rss_kb / 1024.0


def _snapshot(actor_ids: dict[str, str]) -> dict[str, tuple[int, float]]:
    """label -> (fds, RSS MB) for the driver and each actor in ``actor_ids`` (label -> actor id)."""
    alive = _alive_actors()
    out = {"driver": _proc(os.getpid())}
    for label, actor_id in actor_ids.items():
        out[label] = _proc(alive[actor_id]["Pid"])
    return out


def _wait_until(condition, timeout_s: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def _check_step(output) -> None:
    timing = output.meta_info["timing"]
    assert len(output) == PER_STEP
    assert bool(torch.isfinite(output.batch["rm_scores"]).all())
    assert all(math.isfinite(float(s)) for s in output.non_tensor_batch["rm_score"])
    assert timing["async_rm/requests"] == PER_STEP and timing["async_rm/scored"] == PER_STEP
    assert timing["async_rm/errors"] == 0 and timing["async_rm/rm_failed_items"] == 0
    assert timing["async_rm/service_restarts_total"] == 0


@pytest.mark.timeout(900)
def test_many_steps_grow_nothing_and_shutdown_leaves_nothing(ray_local, tiny_models):
    servers, balancer = generation(ray_local, tiny_models)  # the cluster's, shared: alive before and after this test
    actors_before, groups_before = set(_alive_actors()), _live_groups()
    with running_manager(ray_local, tiny_models, "v0", num_workers=2) as (manager, _):
        service, replicas = manager.rm_service, replicas_of(manager)
        ours = {"rm_service": service._actor_id.hex()}
        ours.update({f"rm_replica_{i}": h._actor_id.hex() for i, h in enumerate(replicas)})
        ours.update({f"agent_loop_worker_{i}": h._actor_id.hex() for i, h in enumerate(manager.agent_loop_workers)})
        # everything else the set-up started (verl's reward-loop workers)
        started = set(_alive_actors()) - actors_before
        names = {a["ActorID"]: a["ActorClassName"] for a in _alive_actors().values()}
        for actor_id in sorted(started - set(ours.values())):
            ours[f"{names[actor_id]}_{actor_id[:6]}"] = actor_id
        assert set(ours.values()) <= started
        ours.update({f"generation_server_{i}": h._actor_id.hex() for i, h in enumerate(servers.values())})
        ours["load_balancer"] = balancer._actor_id.hex()
        our_groups = _live_groups() - groups_before
        assert our_groups  # the RM pool's placement group(s)

        step_s = []
        for step in range(STEPS):
            t0 = time.monotonic()
            output = manager.generate_sequences(prompts_batch(N_PROMPTS, rollout_n=ROLLOUT_N))
            step_s.append(time.monotonic() - t0)
            _check_step(output)
            if step == WARMUP - 1:
                warm_actors, warm_groups = _new_actors(actors_before), _live_groups() - groups_before
                warm = _snapshot(ours)
        end_actors, end_groups, end = _new_actors(actors_before), _live_groups() - groups_before, _snapshot(ours)
        stats = ray.get(manager.rm_service.stats.remote(), timeout=60)

        mean_s, warm_mean_s = sum(step_s) / STEPS, sum(step_s[WARMUP:]) / (STEPS - WARMUP)
        report = [
            f"soak: {STEPS} steps of {PER_STEP} trajectories, step time mean {mean_s:.2f} s, "
            + f"after warm-up {warm_mean_s:.2f} s, max {max(step_s):.2f} s",
            f"alive actors started by this test {len(warm_actors)} -> {len(end_actors)}, "
            + f"its live placement groups {len(warm_groups)} -> {len(end_groups)}",
        ]
        for label in warm:
            report.append(f"  {label:32s} fds {warm[label][0]:4d} -> {end[label][0]:4d}   "
                          f"RSS {warm[label][1]:8.1f} -> {end[label][1]:8.1f} MB")
        print("\n".join(report))

        assert manager.rm_service is service and replicas_of(manager) == replicas
        # only what this test started counts: an earlier test's actor may still be dying (its owner's death reaches
        # it late), which is neither growth nor a leak of this run
        assert end_actors == warm_actors, {"appeared": end_actors.keys() - warm_actors.keys(),
                                           "gone": {a: warm_actors[a] for a in warm_actors.keys() - end_actors.keys()}}
        assert end_groups == warm_groups
        for label in warm:
            assert end[label][0] - warm[label][0] <= MAX_FD_GROWTH, (label, warm[label], end[label])
            assert end[label][1] - warm[label][1] <= MAX_RSS_GROWTH_MB, (label, warm[label], end[label])
        # the service's per-request books are closed: every request answered, nothing waiting, running or failed
        assert stats["submitted"] == stats["completed"] == STEPS * PER_STEP
        assert stats["failed"] == stats["timed_out"] == stats["cancelled"] == stats["rejected"] == 0
        assert stats["queue_len"] == 0  # every waiting request is queued: no "blocked" count since max_pending went
        assert stats["in_flight_batches"] == stats["in_flight_requests"] == 0
        assert stats["batches"] >= STEPS  # at least one batch a step

    # after the context manager's shutdown: the RM service, the RM replicas and the agent-loop workers are dead, and
    # every placement group made here is REMOVED
    plugin = {label: i for label, i in ours.items() if label.startswith(("rm_service", "rm_replica", "agent_loop"))}
    assert _wait_until(lambda: not (set(plugin.values()) & set(_alive_actors()))), \
        {label: i for label, i in plugin.items() if i in _alive_actors()}
    assert _wait_until(lambda: not (our_groups & _live_groups())), our_groups & _live_groups()
    # once the driver drops the manager, nothing started here is left: the rest was killed
    del manager, service, replicas, output
    gc.collect()
    assert _wait_until(lambda: set(_alive_actors()) <= actors_before), \
        [names.get(i, i) for i in set(_alive_actors()) - actors_before]
