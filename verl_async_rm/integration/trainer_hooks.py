"""The one place the plugin wraps verl methods: the v1 trainer's ``PPOTrainer.step`` and ``_validate`` and the
trainer's own ``on_sample_end`` / ``on_step_end`` (:func:`install`, :func:`hook_phases`); the v0 trainer's
``RayPPOTrainer._validate`` (:func:`install_v0`).

verl 0.9.1 gives the agent-loop manager no step boundary and no channel to its tracker; its fit loops log what v1's
``step`` puts in ``metrics`` and what ``_validate`` returns (both trainers), so the wrappers close the phase there.
They do nothing unless the trainer's manager is the plugin's, and a trainer class that overrides the wrapped method
bypasses them. v1 is imported only by :func:`install`, when a v1 manager is built."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from verl_async_rm.errors import RMScoreError, TrajectoryDroppedError

logger = logging.getLogger(__name__)

__all__ = ["install", "install_v0", "installed", "closing", "hook_phases", "CLOSE_METHOD", "SLEEP_METHOD",
           "WAKE_METHOD"]

#: The manager method the wrappers call: ``close(phase, global_steps) -> metrics``.
CLOSE_METHOD = "async_rm_close"
#: The manager methods the trainer's phase hooks call (:func:`hook_phases`): the RMs on the policy's GPUs sleep
#: while the policy trains and wake before the next rollout.
SLEEP_METHOD, WAKE_METHOD = "async_rm_sleep", "async_rm_wake"
_MARK = "__async_rm_wrapped__"
_PHASES_MARK = "_async_rm_phases_hooked"
T = TypeVar("T")


def _call(trainer: Any, method: str, *args: Any) -> Any:
    """The manager's ``method(*args)``; {} without the plugin's manager."""
    # v1's trainer names its manager agent_loop_manager, v0's async_rollout_manager
    manager = getattr(trainer, "agent_loop_manager", None) or getattr(trainer, "async_rollout_manager", None)
    call = getattr(manager, method, None)
    return call(*args) if callable(call) else {}


def closing(trainer: Any, phase: str, body: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """Run ``body`` (a training step, ``phase='train'``, or a validation pass, ``'val'``), then close the phase:
    ``body``'s result and the phase's metrics ({} without the plugin's manager). If ``body`` raised, the close's RM
    error is raised from it, and ``body``'s own error otherwise."""
    try:
        result = body()
    except Exception:
        try:
            _call(trainer, CLOSE_METHOD, phase, trainer.global_steps)
        except (RMScoreError, TrajectoryDroppedError):
            raise
        except Exception:  # noqa: BLE001 - the step's own error is the one to report
            logger.exception("verl_async_rm: could not close the failed %s phase", phase)
        raise
    return result, _call(trainer, CLOSE_METHOD, phase, trainer.global_steps)


def hook_phases(trainer: Any) -> None:
    """Wrap this trainer's ``on_sample_end`` and ``on_step_end`` (idempotent, per instance: each trainer mode has its
    own): after a step's last sampling the manager's RMs sleep, after the step they wake (a no-op unless they are on
    the policy's GPUs)."""
    if getattr(trainer, _PHASES_MARK, False):
        return
    sample_end, step_end = trainer.on_sample_end, trainer.on_step_end

    def on_sample_end() -> None:
        sample_end()
        last = getattr(trainer, "parameter_sync_step", 1) - 1
        if getattr(trainer, "local_trigger_step", last) >= last:  # the step's last local update samples now
            _call(trainer, SLEEP_METHOD)

    def on_step_end() -> None:
        step_end()
        _call(trainer, WAKE_METHOD)

    trainer.on_sample_end, trainer.on_step_end = on_sample_end, on_step_end
    setattr(trainer, _PHASES_MARK, True)


def installed() -> bool:
    """Whether :func:`install` has wrapped verl's ``PPOTrainer`` in this process."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return hasattr(PPOTrainer.step, _MARK)


def install() -> None:
    """Wrap ``PPOTrainer.step`` and ``PPOTrainer._validate`` (idempotent; called when the v1 manager is built)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    if installed():
        return
    original_step, original_validate = PPOTrainer.step, PPOTrainer._validate

    @functools.wraps(original_step)
    def step(self: Any, metrics: dict, timing_raw: dict) -> Any:
        hook_phases(self)
        batch, extra = closing(self, "train", lambda: original_step(self, metrics, timing_raw))
        metrics.update(extra)
        return batch

    @functools.wraps(original_validate)
    def _validate(self: Any) -> dict:
        val_metrics, extra = closing(self, "val", lambda: original_validate(self))
        return {**val_metrics, **extra}

    setattr(step, _MARK, original_step)
    setattr(_validate, _MARK, original_validate)
    PPOTrainer.step, PPOTrainer._validate = step, _validate
    logger.debug("verl_async_rm: wrapped PPOTrainer.step and PPOTrainer._validate")


def install_v0() -> None:
    """Wrap the v0 trainer's ``RayPPOTrainer._validate`` (idempotent; called when the v0 manager is built): a
    validation pass's ``val-async_rm/*`` go into what it returns, which verl's fit loop logs."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    original = RayPPOTrainer._validate
    if hasattr(original, _MARK):
        return

    @functools.wraps(original)
    def _validate(self: Any, *args: Any, **kwargs: Any) -> dict:
        val_metrics, extra = closing(self, "val", lambda: original(self, *args, **kwargs))
        return {**val_metrics, **extra}

    setattr(_validate, _MARK, original)
    RayPPOTrainer._validate = _validate
