"""RMConfig validation and its conversion from verl's config (new keys, legacy keys, overrides)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from omegaconf import OmegaConf

from verl_async_rm.config import rm_config_from_verl
from verl_async_rm.errors import ConfigValueError
from verl_async_rm.scoring.rm_config import RMConfig

pytestmark = pytest.mark.unit

GOOD = {"model_path": "/models/rm", "policy_tokenizer_path": "/models/policy"}


def test_defaults_are_valid_and_documented():
    cfg = RMConfig(**GOOD)
    assert (cfg.dtype, cfg.attn_implementation, cfg.trust_remote_code) == ("auto", "sdpa", False)
    assert cfg.num_replicas == 1
    import dataclasses

    assert all(f.metadata.get("help") for f in dataclasses.fields(RMConfig))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model_path", ""),
        ("retemplate", "sometimes"),
        ("dtype", "fp8"),
        ("attn_implementation", ""),
        ("max_length", 1),
        ("max_length", 10.5),
        ("score_index", "0"),
        ("score_reduction", "median"),
        ("score_head", ""),
        ("micro_batch_max_tokens", 0),
        ("n_gpus_per_node", 0),
        ("n_gpus_per_node", -2),
        ("nnodes", 0),
        ("nnodes", True),
        ("placement_timeout_s", 0),
        ("init_timeout_s", -1.0),
    ],
)
def test_each_bad_value_names_key_value_and_fix(key, value):
    with pytest.raises(ValueError) as info:
        RMConfig(**{**GOOD, key: value})
    message = str(info.value)
    assert message.startswith(f"{key}={value!r}")
    assert "Fix:" in message
    assert isinstance(info.value, ConfigValueError) and info.value.key == key


def test_policy_tokenizer_is_required_unless_ids_are_reused():
    with pytest.raises(ValueError, match=r"policy_tokenizer_path=None.*retemplate='never'"):
        RMConfig(model_path="/models/rm")
    assert RMConfig(model_path="/models/rm", retemplate="never").policy_tokenizer_path is None


def _verl(**sections):
    base = {
        "actor_rollout_ref": {"model": {"path": "/models/policy", "tokenizer_path": None}},
        "trainer": {"device": "cuda"},
        "reward": {
            "reward_model": {
                "enable": False,
                "enable_resource_pool": True,
                "n_gpus_per_node": 2,
                "nnodes": 1,
                "model_path": "/models/rm",
            }
        },
        "reward_model": {
            "enable_resource_pool": None,
            "n_gpus_per_node": None,
            "nnodes": None,
            "model": {"path": None, "trust_remote_code": None},
        },
    }
    return OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(sections))


def test_from_verl_reads_new_keys():
    cfg = rm_config_from_verl(_verl())
    assert (cfg.model_path, cfg.policy_tokenizer_path) == ("/models/rm", "/models/policy")
    assert (cfg.n_gpus_per_node, cfg.nnodes, cfg.use_gpu, cfg.trust_remote_code) == (2, 1, True, False)


def test_legacy_keys_reach_the_rm_through_verls_migration(tiny_models):
    """Legacy keys are read only once verl's migrate_legacy_reward_impl has moved them (python -m
    verl_async_rm.main_ppo); the plugin's reader has no copy of verl's rule."""
    from verl_async_rm.config import AsyncRMConfig
    from verl_async_rm.main_ppo import migrate_legacy_keys
    from verl_async_rm.testing import compose_trainer_config

    config = compose_trainer_config(tiny_models.policy, overrides=[
        "reward_model.enable_resource_pool=True", "reward_model.n_gpus_per_node=4", "reward_model.nnodes=2",
        "reward_model.model.path=/models/legacy_rm", "reward_model.model.trust_remote_code=True",
        "actor_rollout_ref.model.tokenizer_path=/models/policy_tok"])
    cfg = AsyncRMConfig.from_verl(migrate_legacy_keys(config)).rm
    assert (cfg.model_path, cfg.n_gpus_per_node, cfg.nnodes) == ("/models/legacy_rm", 4, 2)
    assert cfg.trust_remote_code is True
    assert cfg.policy_tokenizer_path == "/models/policy_tok"


@pytest.mark.parametrize(
    ("sections", "key", "value"),
    [
        ({"reward": {"reward_model": {"nnodes": 0}}}, "reward.reward_model.nnodes", 0),
        ({"reward": {"reward_model": {"n_gpus_per_node": -1}}}, "reward.reward_model.n_gpus_per_node", -1),
    ],
)
def test_from_verl_pool_errors_name_the_verl_key(sections, key, value):
    with pytest.raises(ValueError) as info:
        rm_config_from_verl(_verl(**sections))
    message = str(info.value)
    assert message.startswith(f"{key}={value!r}")
    assert f"Fix: set {key} to a positive integer" in message


def test_from_verl_missing_model_path():
    with pytest.raises(ValueError, match=r"reward\.reward_model\.model_path=None.*Fix: set reward\.reward_model"):
        rm_config_from_verl(_verl(reward={"reward_model": {"model_path": None}}))


def test_from_verl_without_a_reward_pool_places_the_rm_on_the_policys_gpus():
    config = _verl(reward={"reward_model": {"enable_resource_pool": False}})
    config.trainer.n_gpus_per_node, config.trainer.nnodes = 4, 2
    rm = rm_config_from_verl(config)
    assert (rm.placement, rm.n_gpus_per_node, rm.nnodes, rm.num_replicas) == ("policy_pool", 4, 2, 8)
    config.trainer.device = "cpu"
    assert rm_config_from_verl(config).use_gpu is False


def test_from_verl_overrides_win_and_unknown_keys_are_named():
    cfg = rm_config_from_verl(_verl(), {"max_length": 4096, "nnodes": 3}, overrides_key="async_rm.rm")
    assert (cfg.max_length, cfg.nnodes) == (4096, 3)
    with pytest.raises(ValueError, match=r"^async_rm\.rm\.max_len=4096: not a setting"):
        rm_config_from_verl(_verl(), {"max_len": 4096}, overrides_key="async_rm.rm")
    with pytest.raises(ValueError, match=r"^async_rm\.rm\.max_length=0"):
        rm_config_from_verl(_verl(), {"max_length": 0}, overrides_key="async_rm.rm")


def test_from_verl_reads_verls_real_trainer_config():
    """The keys read are where verl 0.9.1's own ppo_trainer config puts them (legacy defaults are null)."""
    from hydra import compose, initialize_config_dir

    verl_dir = importlib.util.find_spec("verl").submodule_search_locations[0]
    with initialize_config_dir(config_dir=os.path.join(verl_dir, "trainer", "config"), version_base=None):
        config = compose(
            "ppo_trainer",
            overrides=[
                "reward.reward_model.model_path=/models/rm",
                "reward.reward_model.enable_resource_pool=True",
                "reward.reward_model.n_gpus_per_node=2",
                "reward.reward_model.nnodes=1",
                "actor_rollout_ref.model.path=/models/policy",
            ],
        )
    cfg = rm_config_from_verl(config)
    assert (cfg.model_path, cfg.policy_tokenizer_path, cfg.n_gpus_per_node, cfg.nnodes) == (
        "/models/rm",
        "/models/policy",
        2,
        1,
    )
    assert cfg.use_gpu is True
    config.reward.reward_model.nnodes = 0  # verl's own default: no separate reward pool
    with pytest.raises(ValueError, match=r"^reward\.reward_model\.nnodes=0"):
        rm_config_from_verl(config)


@pytest.mark.parametrize("kind", ["judge", "pairwise_judge"])
def test_a_judge_token_listed_twice_is_refused(tiny_models, kind):
    # at an endpoint nothing else would see it: the readout would give every response 0.5
    with pytest.raises(ConfigValueError, match="judge_tokens.*listed twice"):
        RMConfig(endpoint="http://127.0.0.1:8000", policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                 reward_kind=kind, judge_readout="logits", judge_tokens=("A", "A"))


def test_a_local_vllm_judge_samples_at_judge_temperature(tiny_models):
    from verl_async_rm.scoring.vllm_engine import sampling_options

    base = dict(model_path="/m", policy_tokenizer_path=str(tiny_models.policy), reward_kind="judge",
                judge_readout="generate", use_gpu=False)
    assert sampling_options(RMConfig(**base)) == {"max_tokens": 256, "seed": 0, "temperature": 0.0}
    assert sampling_options(RMConfig(**base, judge_temperature=0.7))["temperature"] == 0.7
    assert "temperature" not in sampling_options(RMConfig(**base, judge_temperature=None))
