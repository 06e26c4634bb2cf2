"""``python -m verl_async_rm.main_ppo`` accepts the legacy top-level reward keys that verl's own main_ppo ignores."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from verl_async_rm.config import AsyncRMConfig
from verl_async_rm.integration.checks import check_verl_config
from verl_async_rm.main_ppo import migrate_legacy_keys
from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit


def legacy_overrides(models) -> list[str]:
    # The legacy keys are declared (null) in verl's ppo_trainer config, so they take no leading '+'.
    return [
        "reward_model.enable_resource_pool=True",
        "reward_model.n_gpus_per_node=3",
        "reward_model.nnodes=2",
        f"reward_model.model.path={models.rm}",
        "reward.reward_manager.name=async_rm",
    ]


@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_legacy_keys_are_migrated_and_then_accepted(tiny_models, trainer):
    cfg = compose_trainer_config(tiny_models.policy, trainer=trainer, overrides=legacy_overrides(tiny_models))
    assert cfg.reward.reward_model.nnodes == 0  # verl's own default: the legacy value has not moved yet

    cfg = migrate_legacy_keys(cfg)

    assert "reward_model" not in cfg and "custom_reward_function" not in cfg and "sandbox_fusion" not in cfg
    check_verl_config(cfg)
    rm = AsyncRMConfig.from_verl(cfg).rm
    assert (rm.n_gpus_per_node, rm.nnodes, rm.num_replicas) == (3, 2, 6)
    assert rm.model_path == str(tiny_models.rm)
    assert cfg.reward.reward_model.enable_resource_pool is True


def test_without_migration_verl_config_fails_with_the_legacy_message(tiny_models):
    cfg = compose_trainer_config(tiny_models.policy, overrides=legacy_overrides(tiny_models))
    with pytest.raises(ValueError, match=r"legacy keys reward_model\.enable_resource_pool=True .*"
                                         r"`python -m verl_async_rm\.main_ppo`"):
        check_verl_config(cfg)


def test_migration_keeps_what_verl_would_drop(tiny_models):
    cfg = compose_trainer_config(
        tiny_models.policy,
        overrides=legacy_overrides(tiny_models)
        + ["reward_model.model.trust_remote_code=True", "custom_reward_function.path=/rules/rule.py"],
    )
    cfg = migrate_legacy_keys(cfg)
    # no reward.* key for it in verl 0.9.1: kept as the plugin's own key
    assert cfg.async_rm.trust_remote_code is True
    assert AsyncRMConfig.from_verl(cfg).rm.trust_remote_code is True
    # the legacy group's name defaults to null; verl's loader needs one
    assert cfg.reward.custom_reward_function.path == "/rules/rule.py"
    assert cfg.reward.custom_reward_function.name == "compute_score"


def test_an_explicit_async_rm_key_wins_over_the_legacy_one(tiny_models):
    cfg = compose_trainer_config(
        tiny_models.policy,
        overrides=legacy_overrides(tiny_models)
        + ["reward_model.model.trust_remote_code=True", "+async_rm.trust_remote_code=False"],
    )
    assert migrate_legacy_keys(cfg).async_rm.trust_remote_code is False


def test_new_style_config_is_left_as_it_is_and_migrating_twice_is_harmless(tiny_models):
    from omegaconf import OmegaConf

    cfg = compose_trainer_config(
        tiny_models.policy,
        overrides=[
            "reward.reward_model.enable_resource_pool=True",
            "reward.reward_model.n_gpus_per_node=2",
            "reward.reward_model.nnodes=1",
            f"reward.reward_model.model_path={tiny_models.rm}",
            "reward.reward_manager.name=async_rm",
        ],
    )
    before = OmegaConf.to_container(cfg.reward, resolve=False)
    once = migrate_legacy_keys(cfg)
    assert OmegaConf.to_container(once.reward, resolve=False) == before
    twice = migrate_legacy_keys(once)
    assert OmegaConf.to_container(twice, resolve=False) == OmegaConf.to_container(once, resolve=False)


def test_verl_main_keeps_its_undecorated_body():
    from verl.trainer import main_ppo

    assert main_ppo.main.__wrapped__.__module__ == "verl.trainer.main_ppo"
    assert main_ppo.main.__wrapped__.__code__.co_argcount == 1


def test_the_entry_module_migrates_then_checks_before_starting_ray(tiny_models, tmp_path):
    """The real command line: hydra finds verl's config, the legacy keys are migrated (no legacy error), and a
    remaining mistake is reported before any Ray cluster starts."""
    overrides = [o for o in legacy_overrides(tiny_models) if not o.startswith("reward.reward_manager.name")]
    overrides.append("reward.reward_manager.name=naiv")  # a misspelt reward manager: the remaining mistake
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "verl_async_rm.main_ppo", f"actor_rollout_ref.model.path={tiny_models.policy}",
         *overrides, f"hydra.run.dir={tmp_path}"],  # hydra's own key: its log folder, instead of ./outputs
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "ValueError: reward.reward_manager.name='naiv' (source='register') does not resolve" in proc.stderr, \
        proc.stderr[-3000:]
    assert "legacy keys" not in proc.stderr
    assert "ray init kwargs" not in proc.stdout  # verl's run_ppo prints this when it starts Ray


def test_verls_own_main_ppo_reports_a_bad_plugin_key_before_starting_ray(tiny_models, tmp_path):
    """``python -m verl.trainer.main_ppo`` (verl's entry, not the plugin's): the plugin's checks run inside verl's
    ``validate_config`` (the plugin's import hook, ``plugin.check_config_first``), so a bad ``async_rm`` value fails
    before verl's ``run_ppo`` starts Ray and the policy's workers."""
    from verl_async_rm.testing.cpu_trainer import cpu_trainer_overrides, plugin_overrides

    overrides = [*cpu_trainer_overrides(policy_path=str(tiny_models.policy), train_files="unused.parquet",
                                        val_files="unused.parquet"),
                 *plugin_overrides(str(tiny_models.rm), extra=["+async_rm.max_wait_ms=-5"])]
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *overrides, f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"}, timeout=240, cwd=tmp_path)
    assert proc.returncode != 0
    assert "async_rm.max_wait_ms" in proc.stderr and "-5" in proc.stderr, proc.stderr[-3000:]
    assert "check_verl_config" in proc.stderr and "run_ppo" not in proc.stderr  # raised in verl's validate_config
    assert "ray init kwargs" not in proc.stdout  # verl's run_ppo prints this when it starts Ray


def test_verls_validate_config_is_wrapped_for_plugin_runs_only(tiny_models):
    import verl.trainer.main_ppo as verl_main_ppo
    import verl.utils.config

    from verl_async_rm.plugin import check_config_first

    assert verl.utils.config.validate_config.async_rm_checks  # the plugin's hook ran on verl's import
    assert verl_main_ppo.validate_config is verl.utils.config.validate_config  # main_ppo bound the wrapper
    # the wrapper's choice, on a module whose validate_config only records its calls (verl's needs a whole run's
    # batch sizes; the test above runs it for real)
    calls = []
    module = SimpleNamespace(validate_config=lambda config, **kwargs: calls.append(kwargs))
    check_config_first(module)
    check_config_first(module)  # idempotent: wrapped once
    bad = ["+async_rm.max_wait_ms=-5"]
    opted_in = compose_trainer_config(tiny_models.policy, trainer="v1", overrides=[
        "reward.reward_manager.name=async_rm", f"reward.reward_model.model_path={tiny_models.rm}", *bad])
    with pytest.raises(ValueError, match="async_rm.max_wait_ms"):
        module.validate_config(opted_in, use_critic=False)
    module.validate_config(compose_trainer_config(tiny_models.policy, trainer="v1", overrides=bad), use_critic=False)
    manager = "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
    plugins = ("verl_async_rm.AsyncRMAgentLoopManager", "verl_async_rm.demo.v0_timing.TimedAsyncRMAgentLoopManager")
    for opting_in in plugins:
        with pytest.raises(ValueError, match="async_rm.max_wait_ms"):
            module.validate_config(compose_trainer_config(tiny_models.policy, trainer="v0", overrides=[
                manager + opting_in, f"reward.reward_model.model_path={tiny_models.rm}", *bad]), use_critic=False)
    # the demo's mode without an RM: verl's own manager, timed by a class of this package, and no RM path
    module.validate_config(compose_trainer_config(tiny_models.policy, trainer="v0", overrides=[
        manager + "verl_async_rm.demo.v0_timing.TimedAgentLoopManager", *bad]), use_critic=False)
    assert calls == [{"use_critic": False}] * 5  # verl's own checks ran first, every time
