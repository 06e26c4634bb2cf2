"""The executor's batch function for the RM worker group: one batch of requests, scored on one replica (slot)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import ray

from verl_async_rm.errors import BatchResultError, ReplicaLostError, ReplicaTimeoutError, RewardModelError
from verl_async_rm.rm.config import RMConfig
from verl_async_rm.rm.request import RMRequest

logger = logging.getLogger(__name__)

__all__ = ["RMBatchFn"]


class RMBatchFn:
    """``async batch_fn(items, slot) -> list`` for the executor; ``slot`` is one RM replica's actor handle.

    Returns one entry per item, in order: a float score, or the exception that failed that item (bad input,
    NaN/inf score, ...). A failure of the whole call is raised instead:

    - the replica died: :class:`ReplicaLostError` (a ``SlotLostError``): the executor re-queues the batch on the
      other replicas and replaces this one;
    - the replica's ``score`` raised: :class:`RewardModelError`, which the executor may bisect to find the item;
    - no answer within ``timeout_s``: :class:`ReplicaTimeoutError` (also a ``RequestTimeoutError``) for the batch's
      requests; the call is left running (a synchronous actor cannot be interrupted) and its ``slot_ready`` tells
      the executor to give the replica no new batch until it answers. A replica still silent ``late_limit_s``
      later (default ``2 * timeout_s``) is declared lost (:class:`ReplicaLostError`): killed and replaced.

    Picklable (plain attributes), so it can be handed to an executor actor.

    Args:
        timeout_s: longest wait for one batch.
        method: the replica's scoring method.
        late_limit_s: how long after a timeout a replica may stay busy with the late call before it counts as lost;
            None: ``2 * timeout_s``.
    """

    def __init__(self, timeout_s: float = 600.0, method: str = "score", late_limit_s: float | None = None) -> None:
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.method = method
        self.late_limit_s = 2.0 * self.timeout_s if late_limit_s is None else _seconds("late_limit_s", late_limit_s)

    @classmethod
    def from_config(cls, config: RMConfig) -> RMBatchFn:
        """A batch function waiting at most ``config.score_timeout_s`` per batch."""
        return cls(timeout_s=config.score_timeout_s)

    async def __call__(self, items: Sequence[RMRequest], slot: Any) -> list[float | Exception]:
        """Score ``items`` on the replica ``slot``; one float or exception per item."""
        items = list(items)
        if not items:
            return []
        ref = getattr(slot, self.method).remote(items)
        answer = asyncio.wrap_future(ref.future())
        try:
            done, _ = await asyncio.wait({answer}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            _cancel(ref)
            answer.cancel()
            raise
        if not done:
            answer.add_done_callback(_consume)
            raise ReplicaTimeoutError(
                f"RM replica did not score a batch of {len(items)} within score_timeout_s={self.timeout_s:g}s; it "
                "gets no new batch until it answers. Fix: raise score_timeout_s, or lower max_batch_size / "
                "micro_batch_max_tokens",
                slot_ready=_late_answer(answer, self.late_limit_s),
            )
        try:
            results = answer.result()
        except ray.exceptions.RayActorError as err:
            raise ReplicaLostError(f"RM replica is gone: {err}") from err
        except ray.exceptions.RayError as err:
            cause = getattr(err, "cause", None) or err  # RayTaskError carries the replica's own exception
            raise RewardModelError(f"RM replica failed on a batch of {len(items)}: {cause!r}") from err
        if not isinstance(results, list) or len(results) != len(items):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise BatchResultError(f"RM replica returned {got} results for {len(items)} requests")
        return [_entry(result) for result in results]


def _entry(result: Any) -> float | Exception:
    if isinstance(result, Exception):
        return result
    if isinstance(result, float):
        return result
    return RewardModelError(f"RM replica returned {type(result).__name__} where a float score was expected")


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{key}={value!r}: must be a positive number of seconds. Fix: {key}=600")
    return float(value)


async def _late_answer(answer: asyncio.Future, limit_s: float) -> None:
    """Wait for a late call; a replica that stays silent ``limit_s`` longer is lost (the executor replaces it)."""
    done, _ = await asyncio.wait({answer}, timeout=limit_s)
    if not done:
        raise ReplicaLostError(
            f"RM replica still had not answered a batch {limit_s:g}s after it timed out; treating it as lost"
        )
    answer.result()  # a dead replica raises its RayActorError here: the slot is lost too


def _consume(answer: asyncio.Future) -> None:
    """Retrieve the outcome of a call that was given up on, so asyncio does not log it as never retrieved."""
    if not answer.cancelled() and answer.exception() is not None:
        logger.debug("a late RM call ended with %r", answer.exception())


def _cancel(ref: ray.ObjectRef) -> None:
    """Best effort: a queued call is dropped; a running one on a synchronous actor finishes anyway."""
    try:
        ray.cancel(ref)
    except Exception:
        logger.debug("could not cancel an RM call", exc_info=True)
