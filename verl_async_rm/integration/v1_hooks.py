"""The one place the plugin wraps verl methods: the v1 trainer's training step and validation, for metrics and failures.

verl 0.9.1's v1 trainer gives the agent-loop manager no channel to its tracker and no step boundary: the manager only
sees ``generate_sequences`` calls (training batches, refills, validation, warm-up batches of later steps). The fit loop
(v1 ``PPOTrainer.fit``) runs ``batch = self.step(metrics, timing_raw)`` (sampling, which waits for
the step's groups, then training), merges ``self._validate()``'s metrics when it validates, and logs ``metrics`` with
its ``Tracking`` at ``self.global_steps`` (the initial validation is logged alone, at step 0). Wrapping those two
methods of ``PPOTrainer`` is the narrowest channel that sees both ends of a step and its failures:

- ``step``: the training step ends: the manager closes it, adds ``async_rm/*`` to the step's ``metrics``, and raises if
  a trajectory of it lost its RM score under ``on_error=raise`` (or more than ``drop_budget`` under ``drop``);
- ``_validate``: the same for the validation pass, under ``val-async_rm/*``.

If verl's own code raises first (its sync replay buffer stops when every trajectory of a group failed and
``sync_refill_failed_groups`` is off), the manager's error for the RM failure is raised from it, so the run stops naming
the trajectory and the RM's cause. Both wrappers do nothing unless the trainer's ``agent_loop_manager`` is the
plugin's v1 manager (it has :data:`CLOSE_METHOD`), and they are installed only when such a manager is built
(:func:`install`), so importing the plugin changes nothing in verl. A user trainer class that overrides ``step`` or
``_validate`` bypasses them (the figures then stay in ``manager.last_metrics``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from verl_async_rm.errors import RMScoreError, TrajectoryDroppedError

logger = logging.getLogger(__name__)

__all__ = ["install", "installed", "closing", "CLOSE_METHOD"]

#: The manager method the wrappers call: ``close(phase, global_steps) -> metrics``.
CLOSE_METHOD = "async_rm_close"
_MARK = "__async_rm_wrapped__"
T = TypeVar("T")


def _close(trainer: Any, phase: str) -> dict[str, float]:
    manager = getattr(trainer, "agent_loop_manager", None)
    close = getattr(manager, CLOSE_METHOD, None)
    return close(phase, trainer.global_steps) if callable(close) else {}


def closing(trainer: Any, phase: str, body: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """Run ``body`` (a training step, ``phase='train'``, or a validation pass, ``'val'``), then close the phase.

    Returns ``body``'s result and the phase's metrics ({} when the trainer's manager is not the plugin's). The close
    raises the plugin's error when the phase lost RM scores (see the manager's ``async_rm_close``); if ``body`` raised,
    that error is raised from ``body``'s, and ``body``'s own error otherwise.
    """
    try:
        result = body()
    except Exception:
        try:
            _close(trainer, phase)
        except (RMScoreError, TrajectoryDroppedError):
            raise
        except Exception:  # noqa: BLE001 - the step's own error is the one to report
            logger.exception("verl_async_rm: could not close the failed %s phase", phase)
        raise
    return result, _close(trainer, phase)


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
