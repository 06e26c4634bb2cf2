"""``on_error=drop`` on verl's v1 sync replay buffer (``sync_refill_failed_groups=True``): a group whose RM scores
failed takes verl's failure path and is refilled with a fresh prompt; the step trains on the others, counts the drops,
and nothing is trained on a missing score. A later step with more drops than ``drop_budget`` stops the run.

The fit loop is :class:`~verl_async_rm.testing.v1.V1FitLoop` (verl's own dispatch, replay buffer and refill through
``PPOTrainer._add_prompts_to_generate``, the plugin's step-end hook; no policy update) on the cluster's synthetic
generation server. The RM is the NaN-RM (the tiny RM, the policy's tokenizer, whose ``</s>`` embedding is NaN); the
poisoned prompts run the ``poisoned`` agent loop (tests/integration/assets), which ends the response in ``</s>``, the
others verl's single-turn loop, and the refills a fresh question each:

- step 1: ok, POISONED, ok, ok, then one refill: 10 trajectories, 2 dropped (20% <= 25%);
- step 2: POISONED, POISONED, ok, ok, then two refills: 12 trajectories, 4 dropped (33% > 25%): the run stops.

``on_error=drop`` in verl's real trainers: ``test_manager_v1_async.py`` (``colocate_async``, eviction and refill).
"""

from __future__ import annotations

import itertools

import pytest
from manager_cases import RM_W, RULE_W, running_manager

pytestmark = pytest.mark.integration

BUDGET = 0.25
N = 2  # rollout.n (manager_cases)
POISON = "POISONED"


def _prompts(kinds: list[str], step: int):
    from verl_async_rm.testing.v1 import prompt_batch

    return prompt_batch([f"{kind} question {step}.{i}: how many apples are left?" for i, kind in enumerate(kinds)],
                        agent_names=["poisoned" if kind == POISON else "single_turn_agent" for kind in kinds])


@pytest.fixture(scope="module")
def dropping(ray_wide, tiny_models, nan_rm):
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    refills = itertools.count()

    def refill(n: int):
        return prompt_batch([f"refill question {next(refills)}: how many eggs?" for _ in range(n)])

    with running_manager(ray_wide, tiny_models, "v1", "+async_rm.on_error=drop", f"+async_rm.drop_budget={BUDGET}",
                         "trainer.v1.sampler.sync_refill_failed_groups=True", rm_path=nan_rm[0]) as (manager, config):
        fit = V1FitLoop(config, manager, make_prompts=refill)
        prompts = _prompts(["ok", POISON, "ok", "ok"], 1)
        first = fit.train_step(prompts)
        first.dispatched = list(prompts["uid"])
        error = None
        try:
            fit.train_step(_prompts([POISON, POISON, "ok", "ok"], 2))
        except Exception as exc:  # noqa: BLE001 - checked by a test
            error = exc
        yield first, error


def _uid(key: str) -> str:
    return key.split("_")[0]  # a trajectory's key is {uid}_{session}_{index}


def test_the_failed_group_is_dropped_and_refilled_by_verls_sync_replay_buffer(dropping):
    first, _ = dropping
    sampled = [_uid(key) for key in first.keys]
    ok, poisoned = [first.dispatched[i] for i in (0, 2, 3)], first.dispatched[1]
    assert len(sampled) == 4 * N and all(sampled.count(uid) == N for uid in set(sampled))
    assert set(ok) < set(sampled) and poisoned not in sampled  # the fourth group is the refill
    m = first.metrics
    assert (m["async_rm/requests"], m["async_rm/scored"], m["async_rm/dropped"]) == (5 * N, 4 * N, N)


def test_nothing_is_trained_on_a_missing_score(dropping, nan_rm, tiny_models):
    """Every sampled reward is the RM's score of its own ids plus the rule: no NaN, no stand-in value."""
    import torch
    from rm_cases import direct_score, hf_model
    from trainer_cases import rule_reference

    first, _ = dropping
    rm, rule = hf_model(nan_rm[0]), rule_reference(tiny_models.policy)
    for i in range(len(first.keys)):
        prompt, response = first.data["prompts"][i], first.data["responses"][i]
        assert nan_rm[1] not in response.tolist()
        direct = direct_score(rm, torch.cat([prompt, response]).tolist())
        assert first.reward(i) == pytest.approx(RM_W * direct + RULE_W * rule(response.tolist()), abs=1e-4)


def test_more_drops_than_the_budget_stop_the_run(dropping):
    from verl_async_rm.errors import TrajectoryDroppedError

    _, error = dropping
    assert isinstance(error, TrajectoryDroppedError), repr(error)
    assert f"{2 * N} of {6 * N} trajectories of step 2 got no RM score" in str(error)
