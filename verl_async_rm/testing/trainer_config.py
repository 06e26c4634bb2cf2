"""Compose a real verl trainer config (``hydra.compose("ppo_trainer")`` from verl's own config dir) for tiny models.

The result is verl's full ``ppo_trainer`` config with the few overrides a CPU run of the agent loop needs: the tiny
policy path, ``rollout.name=vllm`` (only a name here: :mod:`verl_async_rm.testing.generation` stands in for the
server), short prompts and responses, ``trainer.device=cpu``, two agent-loop and reward-loop workers, and the trainer
version (v1: TransferQueue, ``transfer_queue.enable=True`` with one storage unit; v0: the classic ``RayPPOTrainer``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["verl_config_dir", "compose_trainer_config"]


def verl_config_dir() -> str:
    """Absolute path of the installed verl's ``trainer/config`` folder."""
    import verl

    return os.path.join(os.path.dirname(os.path.abspath(verl.__file__)), "trainer", "config")


def compose_trainer_config(
    policy_path: str | os.PathLike,
    *,
    trainer: str = "v1",
    overrides: Sequence[str] = (),
    prompt_length: int = 128,
    response_length: int = 64,
    rollout_n: int = 1,
    num_workers: int = 2,
):
    """Return verl's ``ppo_trainer`` config (an ``omegaconf.DictConfig``) composed for a CPU run.

    Args:
        policy_path: local policy folder (model + tokenizer), e.g. ``build_tiny_models().policy``.
        trainer: ``"v1"`` (``trainer.use_v1=True``, verl's default) or ``"v0"``.
        overrides: extra Hydra overrides applied last (``key=value``, ``+new.key=value``), exactly as on verl's
            command line.
        prompt_length, response_length: ``data.max_prompt_length`` / ``data.max_response_length``.
        rollout_n: ``actor_rollout_ref.rollout.n``.
        num_workers: agent-loop and reward-loop workers.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if trainer not in ("v0", "v1"):
        raise ValueError(f"trainer must be 'v0' or 'v1', got {trainer!r}")
    base = [
        f"actor_rollout_ref.model.path={os.fspath(policy_path)}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        f"actor_rollout_ref.rollout.agent.num_workers={num_workers}",
        f"reward.num_workers={num_workers}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.use_v1={trainer == 'v1'}",
        f"transfer_queue.enable={trainer == 'v1'}",
        # TransferQueue starts one 1-CPU actor per storage unit (default 8): too many for a small CPU cluster.
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    # hydra keeps one global instance; a caller (or an earlier call) may have initialised it already.
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return compose(config_name="ppo_trainer", overrides=base + list(overrides))
    finally:
        GlobalHydra.instance().clear()
