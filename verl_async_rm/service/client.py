"""The caller's side of :meth:`RMService.score`: every wait bounded, a caller that gives up cancels its request."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from verl_async_rm.errors import RequestTimeoutError
from verl_async_rm.request import RMRequest, ScoreResult

logger = logging.getLogger(__name__)

__all__ = ["score_with_timeout"]

#: How long past the request's deadline the caller still waits for the service's own answer (the Ray hop): only a
#: dead or stuck service takes longer.
_HOP_S = 5.0


async def score_with_timeout(service: Any, request: RMRequest, *, timeout_s: float) -> ScoreResult:
    """Score ``request`` on an RM service: its score, or the error that kept it from being scored, as the service
    returns them (past ``timeout_s``, its deadline there: ``RequestTimeoutError``). Raises only when the service
    is lost: Ray's actor error for a dead one, ``RequestTimeoutError`` for one that does not answer a few seconds
    after the deadline (the call is then cancelled)."""
    import ray

    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    ref = service.score.remote(request, deadline_s=timeout_s)
    # Not asyncio.wait_for: an error the service raised that is a TimeoutError (Ray's wrapper takes its type) must not
    # read as "the service did not answer".
    answer = asyncio.wrap_future(ref.future())
    done: set[asyncio.Future] = set()
    try:
        done, _ = await asyncio.wait({answer}, timeout=timeout_s + _HOP_S)
    finally:
        if not done:  # the caller gave up, or the service did not answer: take the request out of its queue too
            answer.cancel()
            try:  # best effort: the service drops the request if it has not run yet; the service may be gone
                ray.cancel(ref)
            except Exception as exc:  # noqa: BLE001
                logger.debug("could not cancel a score call: %r", exc)
    if done:
        return answer.result()
    raise RequestTimeoutError(
        f"the RM service did not answer within {timeout_s + _HOP_S:g} s (the request's timeout_s={timeout_s:g} and "
        f"{_HOP_S:g} s for the hop); is it alive?")
