"""``recipes/grpo_cpu_tiny.sh``: the command it runs is verl's own ``main_ppo`` with exactly the CPU trainer's
overrides the demo and the trainer tests use (``verl_async_rm.testing.cpu_trainer``) and the README's opt-in, it
composes against verl's config and passes verl's and the plugin's checks, and its paths come from the environment
(else the demo's tiny models and data). Dry runs only (``VERL_ASYNC_RM_RECIPE_DRY_RUN=1``); the recipe runs for real in
``tests/integration/test_cpu_recipe_v0.py`` and ``test_cpu_recipe_v0_policy_pool.py``."""

from __future__ import annotations

import subprocess

import pytest
from test_recipes import MANAGER_KEY, VERL_ENTRY, compose, dry_run, override_key, split_command

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore:Disabled critic as algorithm.adv_estimator:UserWarning"),
]

RECIPE = "grpo_cpu_tiny.sh"
#: Keys the CPU settings add with ``+`` (verl declares no default for them), beside the plugin's own.
CPU_ADDED_KEYS = {
    "actor_rollout_ref.model.override_config.attn_implementation",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision",
    "actor_rollout_ref.rollout.enable_sleep_mode",
    "ray_kwargs.ray_init.num_gpus",
    "ray_kwargs.ray_init.include_dashboard",
}
PATHS = {"POLICY_PATH": "/m/policy", "RM_PATH": "/m/rm", "TRAIN_FILE": "/d/train.parquet", "VAL_FILE": "/d/val.parquet"}


def test_the_recipe_runs_verls_main_ppo_with_the_cpu_trainers_overrides_and_the_opt_in():
    from verl_async_rm.testing.cpu_trainer import cpu_trainer_overrides, plugin_overrides

    subprocess.run(["bash", "-n", f"recipes/{RECIPE}"], check=True, timeout=30)
    entry, overrides = split_command(dry_run(RECIPE, "trainer.total_training_steps=2", **PATHS))
    assert entry == VERL_ENTRY
    expected = cpu_trainer_overrides(policy_path=PATHS["POLICY_PATH"], train_files=PATHS["TRAIN_FILE"],
                                     val_files=PATHS["VAL_FILE"]) + plugin_overrides(PATHS["RM_PATH"])
    assert overrides == [*expected, "trainer.total_training_steps=2"]  # extra arguments go last, to Hydra


def test_rm_placement_policy_pool_puts_the_rm_on_the_policys_gpu_and_a_bad_value_stops():
    from verl_async_rm.testing.cpu_trainer import cpu_trainer_overrides, plugin_overrides

    _, overrides = split_command(dry_run(RECIPE, "trainer.use_v1=False", RM_PLACEMENT="policy_pool", **PATHS))
    expected = cpu_trainer_overrides(policy_path=PATHS["POLICY_PATH"], train_files=PATHS["TRAIN_FILE"],
                                     val_files=PATHS["VAL_FILE"], rm_gpus=0) + plugin_overrides(PATHS["RM_PATH"],
                                                                                                 rm_gpus=0)
    assert overrides == [*expected, "trainer.use_v1=False"]
    config, settings = validate(dry_run(RECIPE, "trainer.use_v1=False", RM_PLACEMENT="policy_pool", **PATHS))
    assert settings.rm.placement == "policy_pool" and config.ray_kwargs.ray_init.num_gpus == 1
    assert config.trainer.use_v1 is False
    bad = subprocess.run(["bash", f"recipes/{RECIPE}"], env={"RM_PLACEMENT": "gpu", "PATH": "/usr/bin:/bin", **PATHS},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "RM_PLACEMENT=gpu: use own_pool" in bad.stderr


def validate(argv: list[str]):
    """What a launch checks before it starts Ray (as ``test_recipes.validate``, with the CPU settings' added keys):
    Hydra refuses undeclared keys, ``+`` only for the CPU keys and the plugin's, verl's ``validate_config``, the
    plugin's checks. Returns (config, AsyncRMConfig)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_async_rm.config import AsyncRMConfig
    from verl_async_rm.integration.checks import check_verl_config

    _, overrides = split_command(argv)
    added = {override_key(o).lstrip("+") for o in overrides if o.startswith("+")}
    assert added - CPU_ADDED_KEYS - {MANAGER_KEY} == set()
    config = compose(overrides)
    check_verl_config(config)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return config, AsyncRMConfig.from_verl(config)


def test_the_command_composes_and_passes_verls_and_the_plugins_checks():
    config, settings = validate(dry_run(RECIPE, **PATHS))
    assert config.trainer.device == "cpu" and config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.actor_rollout_ref.actor.use_kl_loss is True  # the reference model runs too
    assert settings.rm.model_path == PATHS["RM_PATH"] and settings.rm.use_gpu is False
    assert config.ray_kwargs.ray_init.num_gpus == 1 + settings.rm.num_replicas  # a logical GPU each


def test_unset_paths_default_to_the_demos_tiny_models_and_data(tmp_path):
    """With nothing set, the recipe builds the demo's assets (offline) and uses them; a variable set wins."""
    from verl_async_rm.demo.data import demo_assets

    _, overrides = split_command(dry_run(RECIPE, VERL_ASYNC_RM_CACHE=str(tmp_path), RM_PATH="/mine/rm"))
    assets = demo_assets(tmp_path)
    values = dict(o.split("=", 1) for o in overrides)
    assert values["actor_rollout_ref.model.path"] == str(assets.policy)
    assert values["data.train_files"] == str(assets.train_file) and values["data.val_files"] == str(assets.val_file)
    assert values["reward.reward_model.model_path"] == "/mine/rm"
    assert assets.train_file.is_file() and (assets.policy / "config.json").is_file()
