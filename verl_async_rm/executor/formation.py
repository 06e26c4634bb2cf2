"""Which pending requests go into the next batch (a pure function of the queue; no I/O, no clock).

Rules, in order:

1. Everything fits (count and tokens): take everything, oldest first.
2. The oldest request is always taken, so every request eventually leaves the queue.
3. Then every request that has already waited ``max_wait`` ("due"), oldest first. A request that does not fit the
   token budget is deferred and keeps its place at the head of the queue; an oversized request goes alone.
4. With length grouping, the remaining room is filled from a window of the next requests: due ones first, then those
   whose ``num_tokens`` is closest to the oldest request's, so that long and short requests are not mixed when there
   is a choice. Grouping only decides WHICH requests fill a batch that would be full anyway; it never shrinks a batch
   and never puts a younger request ahead of a due one, so it cannot break the age bound.
   Without grouping, the batch is filled strictly oldest-first and stops at the first request that does not fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from verl_async_rm.executor.request import Request

__all__ = ["select_batch"]


def select_batch(
    pending: Iterable[Request],
    *,
    count: int,
    pending_tokens: int,
    max_items: int,
    max_tokens: int | None,
    due_before: float,
    group_by_length: bool,
    window: int,
) -> list[Request]:
    """Pick the next batch from ``pending`` (oldest first, ``count`` requests holding ``pending_tokens`` tokens).

    ``due_before``: a request submitted at or before this time has waited ``max_wait``. ``window``: how many requests
    beyond the due ones length grouping may look at. Returns at least one request when ``pending`` is not empty, at
    most ``max_items``, and more than one only if their tokens fit ``max_tokens``.
    """
    if count <= max_items and (max_tokens is None or pending_tokens <= max_tokens):
        return list(pending)
    it = iter(pending)
    head = next(it, None)
    if head is None:
        return []
    batch = [head]
    tokens = head.num_tokens or 0
    if max_items == 1 or (max_tokens is not None and tokens >= max_tokens):
        return batch  # full, or an oversized request alone
    group = group_by_length and head.num_tokens is not None
    stopped_at: Request | None = None  # the first request phase 1 did not take, if grouping may still use it
    for req in it:
        n = req.num_tokens or 0
        if max_tokens is not None and tokens + n > max_tokens:
            if not group:
                return batch  # strict FIFO: the deferred request keeps its place and opens the next batch
            break  # it does not fit; leave it at the head and let grouping fill the room
        if group and req.t_submit > due_before:
            stopped_at = req
            break
        batch.append(req)
        tokens += n
        if len(batch) >= max_items:
            return batch
    else:
        return batch  # the queue ran out
    candidates = list(islice(it, window))
    if stopped_at is not None:
        candidates.insert(0, stopped_at)
    anchor = head.num_tokens
    assert anchor is not None  # group is only true when the head has a length

    def closeness(req: Request) -> tuple[bool, float, int]:
        n = req.num_tokens
        return (req.t_submit > due_before, abs(n - anchor) if n is not None else float("inf"), req.seq)

    candidates.sort(key=closeness)
    for req in candidates:
        n = req.num_tokens or 0
        if max_tokens is not None and tokens + n > max_tokens:
            continue
        batch.append(req)
        tokens += n
        if len(batch) >= max_items:
            break
    return batch
