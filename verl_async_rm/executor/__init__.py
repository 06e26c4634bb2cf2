"""The pending-request executor: slot-based dynamic batching of single reward requests that never hangs.

``PendingRequestExecutor`` is pure asyncio and Ray-free; ``create_executor_actor`` wraps it in a Ray async actor that
many agent-loop workers call at once. The knobs are in :class:`BatchPolicy`.

In process::

    async def batch_fn(items: list, slot) -> list:       # one result or Exception instance per item, in order
        return await slot.score.remote(items)             # e.g. slot = the Ray handle of one RM replica

    executor = PendingRequestExecutor(batch_fn, BatchPolicy(max_batch_size=64, max_wait_ms=20), slots=replicas)
    score = await executor.submit(item, num_tokens=len(ids), deadline_s=60)
    executor.drain()                                      # end of a rollout step: flush what is pending now
    await executor.aclose()

As a shared Ray actor (every await carries a timeout)::

    actor = create_executor_actor(RMBatchFn(), {"max_batch_size": 64}, replicas, name="rm-executor", namespace=ns)
    score = await submit_with_timeout(actor, item, timeout_s=60, num_tokens=len(ids))

Layout: ``policy`` (BatchPolicy), ``core`` (the executor and its supervised loop), ``waiting`` (the queue),
``formation`` (which requests form the next batch), ``runner`` (one batch on one slot: results, bisection),
``stats``, ``actor`` (Ray wrapper), ``testing`` (gated batch function and virtual-time loop for tests).
"""

from __future__ import annotations

from verl_async_rm.executor.actor import ExecutorActor, create_executor_actor, submit_with_timeout
from verl_async_rm.executor.core import BatchFn, PendingRequestExecutor
from verl_async_rm.executor.policy import OVERFLOW_MODES, BatchPolicy
from verl_async_rm.executor.stats import FLUSH_REASONS

__all__ = [
    "BatchFn",
    "BatchPolicy",
    "ExecutorActor",
    "FLUSH_REASONS",
    "OVERFLOW_MODES",
    "PendingRequestExecutor",
    "create_executor_actor",
    "submit_with_timeout",
]
