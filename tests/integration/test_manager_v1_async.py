"""The plugin inside verl's real v1 ``colocate_async`` trainer on CPU (``PPOTrainerColocateAsync``: a warm-up batch,
the rollout of the next batch running on across steps, partial rollouts resumed after each weight sync) with
``on_error=drop``: batches of several steps overlap, a failed group is evicted and refilled by verl's async replay
buffer, every sampled trajectory is scored exactly once, and the step that closes a trajectory counts it.

The RM is the NaN-RM; every prompt runs the demo's sampling agent loop (ordinary tokens only), the one poisoned prompt
its variant that ends the response in ``</s>`` (NaN score). Three steps of 4 prompts x 2 responses.
"""

from __future__ import annotations

import pytest
from trainer_cases import N, PROMPTS, compose, running_trainer, trainer_overrides, write_prompts

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

STEPS = 3
POISONED_ROW = 5  # in step 1's own batch (rows 4-7), after the warm-up batch (rows 0-3)


@pytest.fixture(scope="module")
def overlapping(tiny_models, nan_rm, tmp_path_factory):
    from verl_async_rm.demo.agent_loop import AGENT_NAME, write_agent_loop_config
    from verl_async_rm.demo.data import demo_assets

    out = tmp_path_factory.mktemp("async_v1")
    rows = 8 * PROMPTS
    questions = [f"{'POISONED' if i == POISONED_ROW else 'ok'} question {i}: how many eggs?" for i in range(rows)]
    names = ["poisoned_lognormal" if i == POISONED_ROW else AGENT_NAME for i in range(rows)]
    train = write_prompts(out / "train.parquet", questions, names)
    loops = write_agent_loop_config(out / "loops.yaml", median_tokens=12, sigma=0.8, seed=0, greedy=False, extra={
        "poisoned_lognormal": "async_rm_poison_lognormal_loop.PoisonedLogNormalAgentLoop"})
    config = compose(trainer_overrides(
        demo_assets(tiny_models.root.parent), f"data.train_files={train}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
        "+async_rm.on_error=drop", "+async_rm.drop_budget=0.3", rm_path=nan_rm[0], steps=STEPS,
        trainer_mode="colocate_async"))
    with running_trainer(config, out / "metrics.jsonl") as run:
        run.fit()
        yield run


def test_it_is_verls_colocate_async_trainer(overlapping):
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync

    assert type(overlapping.trainer) is PPOTrainerColocateAsync
    assert [s.step for s in overlapping.steps] == list(range(1, STEPS + 1))


def test_batches_of_different_steps_overlap(overlapping):
    """A trajectory sampled at a later step than its prompt's dispatch: generated (at least partly) with older
    weights, as verl's off-policy metrics count it."""
    staleness = [s.metrics["training/off_policy/trajectory_staleness_worst/max"] for s in overlapping.steps]
    assert max(staleness) >= 1, staleness


def test_every_sampled_trajectory_is_scored_once_and_the_failed_group_evicted(overlapping):
    steps = overlapping.steps
    seen = [key for s in steps for key in s.keys]
    assert len(seen) == len(set(seen)) == STEPS * PROMPTS * N  # no trajectory trained twice
    questions = [raw[-1]["content"] for s in steps for raw in s.raw_prompts]
    assert not any(q.startswith("POISONED") for q in questions)
    assert all(r == r for s in steps for r in s.rewards)  # no NaN reached verl's advantages
    for s in steps:
        m = s.metrics
        assert m["async_rm/requests"] == m["async_rm/scored"] + m["async_rm/errors"]
        assert m["async_rm/dropped"] == m["async_rm/errors"]
    assert sum(s.metrics["async_rm/dropped"] for s in steps) == N  # the poisoned prompt's responses, once
    assert sum(s.metrics.get("training/rollout_failure/evicted_samples", 0) for s in steps) == 1
