"""The pending-request executor: slot-based dynamic batching of single reward requests that never hangs (pure
asyncio, Ray-free; the RM service runs one with the RM replicas as slots).

In process::

    async def batch_fn(items: list, slot) -> list:       # one result or Exception instance per item, in order
        return await slot.score.remote(items)             # e.g. slot = the Ray handle of one RM replica

    executor = PendingRequestExecutor(batch_fn, BatchPolicy(max_batch_size=64, max_wait_ms=20), slots=replicas)
    score = await executor.submit(item, num_tokens=len(ids), deadline_s=60)
    executor.drain()                                      # end of a rollout step: flush what is pending now
    await executor.aclose()
"""

from __future__ import annotations

from verl_async_rm.batching.executor import BatchFn, PendingRequestExecutor
from verl_async_rm.batching.policy import OVERFLOW_MODES, BatchPolicy
from verl_async_rm.batching.stats import FLUSH_REASONS

__all__ = [
    "BatchFn",
    "BatchPolicy",
    "FLUSH_REASONS",
    "OVERFLOW_MODES",
    "PendingRequestExecutor",
]
