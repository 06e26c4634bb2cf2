"""``on_error=drop`` inside verl's real v1 sync trainer on CPU (``sync_refill_failed_groups=True``, verl's own sync
replay buffer): a group whose RM scores failed takes verl's failure path and is refilled from verl's dataloader with
the next prompt; the step trains on the others, counts the drops, and nothing is trained on a missing score. A later
step with more drops than ``drop_budget`` stops verl's fit.

The RM is the NaN-RM (the tiny RM, the policy's tokenizer, whose ``</s>`` embedding is NaN); every prompt runs the
demo's agent loop, which samples ordinary tokens only, and the poisoned prompts its variant that ends the response in
``</s>``. The prompts, in verl's dataloader order (``data.shuffle=False``, one prompt per fetch with refilling):

- step 1: ok, POISONED, ok, ok, then the refill (ok): 10 trajectories, 2 dropped (20% <= 25%);
- step 2: POISONED, POISONED, ok, ok, then two refills: 12 trajectories, 4 dropped (33% > 25%): the run stops.
"""

from __future__ import annotations

import pytest
from trainer_cases import N, RM_W, RULE_W, compose, rule_reference, running_trainer, trainer_overrides, write_prompts

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

BUDGET = 0.25
POISON = "POISONED"
KINDS = ["ok", POISON, "ok", "ok", "ok", POISON, POISON] + ["ok"] * 9


@pytest.fixture(scope="module")
def dropping(tiny_models, nan_rm, tmp_path_factory):
    from verl_async_rm.demo.agent_loop import AGENT_NAME, write_agent_loop_config
    from verl_async_rm.demo.data import demo_assets

    out = tmp_path_factory.mktemp("sync_drop")
    questions = [f"{kind} question {i}: how many apples are left?" for i, kind in enumerate(KINDS)]
    names = ["poisoned_lognormal" if kind == POISON else AGENT_NAME for kind in KINDS]
    train = write_prompts(out / "train.parquet", questions, names)
    loops = write_agent_loop_config(out / "loops.yaml", median_tokens=12, sigma=0.5, seed=0, greedy=False, extra={
        "poisoned_lognormal": "async_rm_poison_lognormal_loop.PoisonedLogNormalAgentLoop"})
    assets = demo_assets(tiny_models.root.parent)
    config = compose(trainer_overrides(
        assets, f"data.train_files={train}", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
        "+async_rm.on_error=drop", f"+async_rm.drop_budget={BUDGET}",
        "trainer.v1.sampler.sync_refill_failed_groups=True",
        rm_path=nan_rm[0], steps=3, short_poll=False))  # verl's own sync sampler: it refills failed groups
    with running_trainer(config, out / "metrics.jsonl") as run:
        error = None
        try:
            run.fit()
        except Exception as exc:  # noqa: BLE001 - checked by a test
            error = exc
        yield run, error


def _questions(step) -> list[str]:
    return [raw[-1]["content"] for raw in step.raw_prompts]


def test_the_failed_group_is_dropped_and_refilled_by_verls_sync_replay_buffer(dropping):
    run, _ = dropping
    first = run.steps[0]
    sampled = {q.split(":")[0] for q in _questions(first)}
    assert sampled == {"ok question 0", "ok question 2", "ok question 3", "ok question 4"}  # 4: the refill
    assert len(first.keys) == 4 * N and all(len(m) == N for m in first.groups().values())
    m = first.metrics
    assert (m["async_rm/requests"], m["async_rm/scored"], m["async_rm/dropped"]) == (5 * N, 4 * N, N)
    assert m["actor/grad_norm"] > 0  # verl trained the step on the others


def test_nothing_is_trained_on_a_missing_score(dropping, nan_rm, tiny_models):
    """Every sampled reward is the RM's score of its own ids plus the rule: no NaN, no stand-in value."""
    import torch
    from rm_cases import hf_model

    run, _ = dropping
    rm, rule = hf_model(nan_rm[0]), rule_reference(tiny_models.policy)
    for i, (prompt, response) in enumerate(zip(run.steps[0].prompts, run.steps[0].responses, strict=True)):
        assert nan_rm[1] not in response
        with torch.no_grad():
            direct = float(rm(input_ids=torch.tensor([prompt + response])).logits[0, 0])
        assert run.steps[0].rewards[i] == pytest.approx(RM_W * direct + RULE_W * rule(response), abs=1e-4)


def test_more_drops_than_the_budget_stop_verls_fit(dropping):
    from verl_async_rm.errors import TrajectoryDroppedError

    run, error = dropping
    assert isinstance(error, TrajectoryDroppedError), repr(error)
    assert f"{2 * N} of {6 * N} trajectories of step 2 got no RM score" in str(error)
    assert [s.step for s in run.steps] == [1]
