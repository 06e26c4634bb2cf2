"""AsyncRMAgentLoopManager on verl's v0 trainer path: real verl agent loop, reward loop, RM worker group, executor."""

from __future__ import annotations

import pytest
import torch
from manager_cases import RM_W, RULE_W, prompts_batch, replicas_of, running_manager

pytestmark = pytest.mark.integration

PRESET_REWARD = 7.25  # set by tests/integration/assets/async_rm_preset_loop.py (imported by the Ray workers, not here)


@pytest.fixture(scope="module")
def v0_manager(ray_local, tiny_models):
    with running_manager(ray_local, tiny_models, "v0", num_workers=2) as (manager, config):  # requests of both workers
        yield manager, config


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


def test_every_sample_scored_as_weighted_rm_plus_rule(v0_manager, tiny_models):
    from transformers import AutoTokenizer

    manager, _ = v0_manager
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


def test_second_step_reuses_pool_replicas_and_service(v0_manager):
    import ray

    manager, _ = v0_manager
    before = _cluster_objects(ray)
    replicas, service = replicas_of(manager), manager.rm_service
    output = manager.generate_sequences(prompts_batch(2, rollout_n=2))
    assert _cluster_objects(ray) == before  # no new named actor, no new placement group
    assert replicas_of(manager) == replicas and manager.rm_service is service
    assert output.meta_info["timing"]["async_rm/requests"] == 4


def test_an_agent_loop_that_sets_its_reward_skips_the_rm(v0_manager, tiny_models):
    manager, _ = v0_manager
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


def _rm_pool_groups(ray) -> dict[str, str]:
    return {pg_id: pg["state"] for pg_id, pg in ray.util.placement_group_table().items()
            if "verl_async_rm_pool" in (pg.get("name") or "")}


def test_shutdown_releases_the_pool_and_the_service(v0_manager):
    import ray

    manager, _ = v0_manager
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
