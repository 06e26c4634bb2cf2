"""``ReplicaCall``: the executor's batch function for the RM service: one batch scored on one replica (slot)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import ray

from verl_async_rm.errors import AsyncRMError, ReplicaLostError, RewardModelError
from verl_async_rm.request import RMRequest

logger = logging.getLogger(__name__)

__all__ = ["ReplicaCall"]


class ReplicaCall:
    """``async batch_fn(items, replica) -> list``: ``replica.score(items)``, with Ray's failures mapped to the
    executor's contract.

    Returns one entry per item, in order: a float score, or the exception that failed that item (the replica isolates
    bad inputs, non-finite scores and failing forwards per item itself). A failure of the whole call raises:

    - the replica died: :class:`ReplicaLostError` (a ``SlotLostError``): the executor re-queues the batch on the other
      replicas and replaces this one;
    - the replica's ``score`` raised: :class:`RewardModelError` for the whole batch.

    The call has no timeout of its own: the executor's ``batch_timeout_s`` is the one bound on a batch. When the
    executor gives up on a call (timeout, or closing) it cancels this coroutine; a synchronous replica cannot be
    interrupted, so the coroutine then waits for the late answer, at most ``late_limit_s``, and the executor gives the
    replica no new batch meanwhile. A replica still silent after that, or dead, raises :class:`ReplicaLostError`: the
    executor kills and replaces it.

    Args:
        late_limit_s: how long a replica may go on with a call that was given up on before it counts as lost.
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
            cause = getattr(err, "cause", None)  # a RayTaskError carries the replica's own exception
            if isinstance(cause, AsyncRMError):  # already typed where it happened
                raise cause from err
            raise RewardModelError(f"RM replica failed on a batch of {len(items)}: {cause or err!r}") from err
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
