"""``ReplicaCall``: the RM service's batch function: one batch scored on one replica (slot)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import ray

from verl_async_rm.errors import AsyncRMError, ReplicaLostError, RewardModelError, remote_cause
from verl_async_rm.request import RMRequest

logger = logging.getLogger(__name__)

__all__ = ["ReplicaCall"]


class ReplicaCall:
    """``async batch_fn(items, replica) -> list``: ``replica.score(items)``, one score or per-item exception each.

    A failure of the whole call raises: :class:`ReplicaLostError` (a ``SlotLostError``: re-queued, replica replaced)
    when the replica died; the replica's own error when it raised a typed one, else :class:`RewardModelError`.

    No timeout of its own: ``batch_timeout_s`` is the one bound on a batch. A synchronous replica cannot be
    interrupted, so a call the executor gave up on (cancelled) waits for the late answer, at most ``late_limit_s``,
    during which the executor gives the replica no new batch; still silent after that, it is lost.
    """

    def __init__(self, late_limit_s: float) -> None:
        if isinstance(late_limit_s, bool) or not isinstance(late_limit_s, int | float) or not late_limit_s > 0:
            raise ValueError(f"late_limit_s={late_limit_s!r}: must be a positive number of seconds")
        self.late_limit_s = float(late_limit_s)

    async def __call__(self, items: Sequence[RMRequest], replica: Any) -> list[float | Exception]:
        items = list(items)
        if not items:
            return []
        answer = asyncio.wrap_future(replica.score.remote(items).future())
        try:
            results = await asyncio.shield(answer)
        except asyncio.CancelledError:
            await self._wait_late(answer, len(items))
            raise
        except ray.exceptions.RayActorError as err:
            raise ReplicaLostError(f"RM replica is gone: {err}") from err
        except ray.exceptions.RayError as err:
            cause = remote_cause(err)
            if isinstance(cause, AsyncRMError):  # already typed where it happened
                raise cause from err
            raise RewardModelError(f"RM replica failed on a batch of {len(items)}: {cause!r}") from err
        return results  # the executor checks there is one entry per item

    async def _wait_late(self, answer: asyncio.Future, size: int) -> None:
        """The executor gave up on the call: hold the replica until it answers; raise if it never does."""
        done, _ = await asyncio.wait({answer}, timeout=self.late_limit_s)
        if not done:
            answer.cancel()
            raise ReplicaLostError(
                f"RM replica still had not answered a batch of {size} {self.late_limit_s:g}s after it was given up "
                "on; treating it as lost"
            )
        if not answer.cancelled() and isinstance(answer.exception(), ray.exceptions.RayActorError):
            raise ReplicaLostError(f"RM replica died during a call that was given up on: {answer.exception()}")
        if not answer.cancelled() and answer.exception() is not None:
            logger.debug("a late RM call ended with %r", answer.exception())
