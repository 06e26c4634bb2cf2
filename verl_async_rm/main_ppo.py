"""``python -m verl_async_rm.main_ppo <verl's overrides>``: verl's ``main_ppo`` with the legacy top-level reward
keys (``reward_model.*``, ...) migrated first by verl's own ``migrate_legacy_reward_impl`` (verl 0.9.1's ``main_ppo``
ignores them), the config checked before Ray starts, then verl's ``main`` body unchanged."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import hydra
from omegaconf import OmegaConf

from verl_async_rm.options import select as _select

__all__ = ["migrate_legacy_keys", "main"]

logger = logging.getLogger(__name__)


def _verl_config_dir() -> str:
    # Found without importing verl (its import takes seconds); hydra needs an absolute path for a foreign package.
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed; install verl==0.9.1 (installing this package from its checkout, "
                          "pip install /path/to/checkout, pulls it in)")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


def migrate_legacy_keys(config: Any) -> Any:
    """verl's ``migrate_legacy_reward_impl`` on a composed ``ppo_trainer`` config (idempotent), after closing two
    of its gaps: ``reward_model.model.trust_remote_code`` (no ``reward.*`` key in verl 0.9.1) becomes
    ``async_rm.trust_remote_code``, and a legacy ``custom_reward_function.path`` gets the new key's function name."""
    if "reward_model" not in config:
        return config
    from verl.experimental.reward_loop import migrate_legacy_reward_impl

    from verl_async_rm.integration.checks import legacy_keys_set

    trust_remote_code = _select(config, "reward_model.model.trust_remote_code")
    if trust_remote_code is not None and _select(config, "async_rm.trust_remote_code") is None:
        OmegaConf.update(config, "async_rm.trust_remote_code", trust_remote_code, force_add=True)
    if _select(config, "custom_reward_function.path") is not None:
        if _select(config, "custom_reward_function.name") is None:
            config.custom_reward_function.name = _select(config, "reward.custom_reward_function.name")
    moved = legacy_keys_set(config)
    config = migrate_legacy_reward_impl(config)
    if moved:
        logger.info("verl_async_rm: migrated legacy keys to reward.*: %s", moved)
    return config


@hydra.main(config_path=_verl_config_dir(), config_name="ppo_trainer", version_base=None)
def main(config: Any) -> None:
    """Migrate the legacy keys, check the config, then run verl's ``verl.trainer.main_ppo.main`` on it."""
    from verl.trainer import main_ppo as verl_main_ppo

    from verl_async_rm.integration.checks import check_verl_config, probe_endpoints

    config = migrate_legacy_keys(config)
    probe_endpoints(check_verl_config(config))
    # hydra.main wraps with functools.wraps, so __wrapped__ is verl's undecorated body
    verl_main_ppo.main.__wrapped__(config)


if __name__ == "__main__":
    main()
