"""compose_trainer_config gives verl's real ppo_trainer config, set up for a CPU agent-loop run."""

from __future__ import annotations

import pytest

from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_composes_verl_config_for_each_trainer(tiny_models, trainer):
    cfg = compose_trainer_config(tiny_models.policy, trainer=trainer, rollout_n=2, prompt_length=96)
    assert cfg.actor_rollout_ref.model.path == str(tiny_models.policy)
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    assert cfg.actor_rollout_ref.rollout.n == 2
    assert cfg.actor_rollout_ref.rollout.prompt_length == 96  # verl's own interpolation from data.*
    assert cfg.trainer.device == "cpu"
    assert cfg.trainer.use_v1 is (trainer == "v1")
    assert cfg.transfer_queue.enable is (trainer == "v1")
    assert cfg.reward.reward_model.enable is False  # verl's own default, untouched


def test_user_overrides_apply_last_and_new_keys_need_plus(tiny_models):
    cfg = compose_trainer_config(
        tiny_models.policy,
        overrides=["reward.reward_model.enable_resource_pool=True", "+async_rm.max_batch_size=7"],
    )
    assert cfg.reward.reward_model.enable_resource_pool is True
    assert cfg.async_rm.max_batch_size == 7
    with pytest.raises(Exception, match="async_rm"):
        compose_trainer_config(tiny_models.policy, overrides=["async_rm.max_batch_size=7"])


def test_rejects_unknown_trainer(tiny_models):
    with pytest.raises(ValueError, match="'v0' or 'v1'"):
        compose_trainer_config(tiny_models.policy, trainer="v2")
