"""AsyncRMAgentLoopManager on verl's v0 trainer path: real verl agent loop, reward loop, RM worker group, batcher.

One manager serves the module (two agent-loop and two reward-loop workers: requests of both), its tests in order:
every score exact, a second step on the same pool and service, an agent loop that sets its own reward, the soak,
then the shutdown.

Soak: many small steps in a row through the whole v0 integration. Measured after ``WARMUP`` steps and again after
``STEPS``: the alive Ray actors and the placement groups not REMOVED (cluster-wide counts), and, for the driver and
every actor process the manager set-up started (RM service, RM replicas, agent-loop workers, verl's reward-loop
workers, the generation server), the open file descriptors (``/proc/<pid>/fd``) and the resident memory
(``VmRSS``). At the end the RM service's books must be closed: nothing waiting or running, ``completed ==
submitted``. After the manager's shutdown no actor started here is alive and every placement group made here is
REMOVED.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from manager_cases import RM_W, RULE_W, generation, prompts_batch, replicas_of, running_manager

# Imported here, not first inside running_manager: verl modules that fail to import while the integration loads
# (verl/checkpoint_engine/{nccl,hccl}_checkpoint_engine.py without cupy/vllm) leave tracebacks behind that hold the
# importing frames; a first import from running_manager's frame would keep that frame, and the manager in it, alive.
import verl_async_rm.integration.agent_loop_manager  # noqa: F401

pytestmark = pytest.mark.integration

PRESET_REWARD = 7.25  # set by tests/integration/assets/async_rm_preset_loop.py (imported by the Ray workers, not here)

STEPS = int(os.environ.get("VERL_ASYNC_RM_SOAK_STEPS", "200"))  # ~0.1 s a step here
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


@pytest.fixture(scope="module")
def v0(ray_local, tiny_models):
    """The module's manager (module doc), with what the soak and the shutdown compare against: the actors and
    placement groups alive before it, and the ones it started (``ours``: label -> actor id). ``teardown()`` ends
    it as the fixture would (``running_manager``'s exit)."""
    servers, balancer = generation(ray_local, tiny_models)  # the cluster's, shared: alive before and after
    actors_before, groups_before = set(_alive_actors()), _live_groups()
    with contextlib.ExitStack() as stack:
        manager, config = stack.enter_context(running_manager(ray_local, tiny_models, "v0", num_workers=2))
        ours = {"rm_service": manager.rm_service._actor_id.hex()}
        ours.update({f"rm_replica_{i}": h._actor_id.hex() for i, h in enumerate(replicas_of(manager))})
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
        yield SimpleNamespace(manager=manager, config=config, actors_before=actors_before, groups_before=groups_before,
                              ours=ours, names=names, our_groups=our_groups, teardown=stack.close)


def direct_rm_scores(tiny_models, output) -> list[float]:
    """Per-sample RM score by a plain HF forward of prompt + response, read at the last real token."""
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_models.rm, dtype=torch.float32).eval()
    scores = []
    for i in range(len(output)):
        mask = output.batch["attention_mask"][i].bool()
        ids = output.batch["input_ids"][i][mask].unsqueeze(0)
        with torch.no_grad():
            hidden = rm.model(input_ids=ids).last_hidden_state
            scores.append(float(rm.score(hidden)[0, -1, 0]))
    return scores


def test_every_sample_scored_as_weighted_rm_plus_rule(v0, tiny_models):
    from transformers import AutoTokenizer

    manager = v0.manager
    output = manager.generate_sequences(prompts_batch(3, rollout_n=2))
    assert len(output) == 6 and "rm_scores" in output.batch.keys()

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    rm_direct = direct_rm_scores(tiny_models, output)
    prompt_len = output.batch["prompts"].shape[1]
    for i in range(len(output)):
        resp_mask = output.batch["attention_mask"][i, prompt_len:]
        last = int(resp_mask.sum()) - 1
        row = output.batch["rm_scores"][i]
        response = tok.decode(output.batch["responses"][i][: last + 1], skip_special_tokens=True)
        rule = (len(response) % 7) / 7.0
        assert float(output.non_tensor_batch["rm_score"][i]) == pytest.approx(rm_direct[i], abs=1e-4)
        assert float(output.non_tensor_batch["rule_score"][i]) == pytest.approx(rule)
        assert float(row[last]) == pytest.approx(RM_W * rm_direct[i] + RULE_W * rule, abs=1e-4)
        assert float(row.abs().sum() - row[last].abs()) == 0.0  # the reward sits only on the last response token
    assert {"rm_score", "rule_score", "rule_len"} <= set(output.meta_info["reward_extra_keys"])

    timing = output.meta_info["timing"]
    assert timing["async_rm/requests"] == 6 and timing["async_rm/scored"] == 6 and timing["async_rm/errors"] == 0
    assert timing["async_rm/batches"] >= 1 and timing["async_rm/mean_batch_size"] >= 1
    for key in ("queue_wait_ms/p99", "rm_exec_ms/p99", "rm_utilization", "reward_tail_s", "mean_fill"):
        assert f"async_rm/{key}" in timing
    assert timing["async_rm/truncated"] == 0 and timing["async_rm/rm_failed_items"] == 0
    assert timing["agent_loop/compute_score/min"] > 0  # verl's own timing now includes the RM wait


def _cluster_objects(ray):
    named = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    groups = {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}
    return named, groups


def test_second_step_reuses_pool_replicas_and_service(v0):
    import ray

    manager = v0.manager
    before = _cluster_objects(ray)
    replicas, service = replicas_of(manager), manager.rm_service
    output = manager.generate_sequences(prompts_batch(2, rollout_n=2))
    assert _cluster_objects(ray) == before  # no new named actor, no new placement group
    assert replicas_of(manager) == replicas and manager.rm_service is service
    assert output.meta_info["timing"]["async_rm/requests"] == 4


def test_an_agent_loop_that_sets_its_reward_skips_the_rm(v0, tiny_models):
    manager = v0.manager
    names = ["preset_reward", "single_turn_agent", "preset_reward", "single_turn_agent"]
    output = manager.generate_sequences(prompts_batch(2, rollout_n=2, agent_names=names))
    prompt_len = output.batch["prompts"].shape[1]
    rm_direct = direct_rm_scores(tiny_models, output)
    for i, name in enumerate(names):
        last = int(output.batch["attention_mask"][i, prompt_len:].sum()) - 1
        if name == "preset_reward":
            assert float(output.batch["rm_scores"][i, last]) == PRESET_REWARD
        else:
            assert float(output.non_tensor_batch["rm_score"][i]) == pytest.approx(rm_direct[i], abs=1e-4)
    assert output.meta_info["timing"]["async_rm/requests"] == 2  # only the two ordinary trajectories reached the RM


def test_many_steps_grow_nothing(v0):
    manager, ours, actors_before, groups_before = v0.manager, v0.ours, v0.actors_before, v0.groups_before
    service, replicas = manager.rm_service, replicas_of(manager)
    start = ray.get(service.stats.remote(), timeout=60)  # the module's earlier steps are on its books too
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
        f"alive actors started by the manager {len(warm_actors)} -> {len(end_actors)}, "
        + f"its live placement groups {len(warm_groups)} -> {len(end_groups)}",
    ]
    for label in warm:
        report.append(f"  {label:32s} fds {warm[label][0]:4d} -> {end[label][0]:4d}   "
                      f"RSS {warm[label][1]:8.1f} -> {end[label][1]:8.1f} MB")
    print("\n".join(report))

    assert manager.rm_service is service and replicas_of(manager) == replicas
    # only what the manager started counts: an earlier module's actor may still be dying (its owner's death reaches
    # it late), which is neither growth nor a leak of this run
    assert end_actors == warm_actors, {"appeared": end_actors.keys() - warm_actors.keys(),
                                       "gone": {a: warm_actors[a] for a in warm_actors.keys() - end_actors.keys()}}
    assert end_groups == warm_groups
    for label in warm:
        assert end[label][0] - warm[label][0] <= MAX_FD_GROWTH, (label, warm[label], end[label])
        assert end[label][1] - warm[label][1] <= MAX_RSS_GROWTH_MB, (label, warm[label], end[label])
    # the service's per-request books are closed: every request answered, nothing waiting, running or failed
    assert stats["submitted"] - start["submitted"] == stats["completed"] - start["completed"] == STEPS * PER_STEP
    assert stats["submitted"] == stats["completed"]
    assert stats["failed"] == stats["timed_out"] == stats["cancelled"] == stats["rejected"] == 0
    assert stats["queue_len"] == 0  # every waiting request is queued: no "blocked" count since max_pending went
    assert stats["in_flight_batches"] == stats["in_flight_requests"] == 0
    assert stats["batches"] - start["batches"] >= STEPS  # at least one batch a step


def _rm_pool_groups(ray) -> dict[str, str]:
    return {pg_id: pg["state"] for pg_id, pg in ray.util.placement_group_table().items()
            if "verl_async_rm_pool" in (pg.get("name") or "")}


def test_shutdown_releases_the_pool_and_the_service_and_leaves_nothing(v0):
    manager = v0.manager
    # earlier tests of the session may have left REMOVED groups behind: look at the live ones only
    before = {pg_id: state for pg_id, state in _rm_pool_groups(ray).items() if state != "REMOVED"}
    assert len(before) >= 1 and set(before.values()) == {"CREATED"}
    service, replicas = manager.rm_service, replicas_of(manager)
    manager.shutdown()
    assert manager.rm_service is None
    for actor in (service, *replicas):
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote() if actor is service else actor.describe.remote(), timeout=60)
    after = _rm_pool_groups(ray)
    assert all(after.get(pg_id, "REMOVED") == "REMOVED" for pg_id in before)
    manager.shutdown()  # idempotent

    # after the manager's teardown (running_manager's exit: verl's reward-loop and the agent-loop workers killed):
    # the RM service, the RM replicas and the agent-loop workers are dead, and every placement group made here is
    # REMOVED
    v0.teardown()
    ours, our_groups = v0.ours, v0.our_groups
    plugin = {label: i for label, i in ours.items() if label.startswith(("rm_service", "rm_replica", "agent_loop"))}
    assert _wait_until(lambda: not (set(plugin.values()) & set(_alive_actors()))), \
        {label: i for label, i in plugin.items() if i in _alive_actors()}
    assert _wait_until(lambda: not (our_groups & _live_groups())), our_groups & _live_groups()
    # once the driver drops the manager, nothing started here is left: the rest was killed
    del manager, service, replicas, v0.manager
    gc.collect()
    assert _wait_until(lambda: set(_alive_actors()) <= v0.actors_before), \
        [v0.names.get(i, i) for i in set(_alive_actors()) - v0.actors_before]
