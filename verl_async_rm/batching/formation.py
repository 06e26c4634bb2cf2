"""Which pending requests go into the next batch (a pure function of the queue; no I/O, no clock).

Rules, in order:

1. Everything fits (count and tokens): take everything, oldest first.
2. The oldest request (the head) is always taken; a head larger than the token budget goes alone.
3. Without length grouping (or when the head has no length), the batch is filled strictly oldest first and stops at the
   first request that does not fit the token budget: that request keeps its place at the head of the queue.
4. With length grouping, the rest of the batch is chosen from the ``window`` requests right after the head: those that
   have waited ``max_wait`` ("due") first, then younger ones; within each (with ``prefer_siblings``) the head's
   siblings first (requests of the head's ``group``, e.g. the other responses to its GRPO prompt, which a packed RM
   scores with their shared prompt computed once), then the lengths closest to the head's (ties oldest first). A
   request that does not fit the remaining token budget is skipped and keeps its place.

Why rule 4 also reorders due requests: under a backlog every queued request is due, and taking due requests oldest first
would mix long and short ones in every batch (about a third of the tokens padding in the overlap benchmark).

No starvation, and how long a request can be passed over: a request is passed over (left in the queue while a younger
one is taken) only while it is one of the ``window`` requests right after the head; requests further back are never
candidates, and neither is anything younger than them. Every batch takes the head, which is ahead of it, so the number
of requests ahead of it drops by at least one per batch: a request is passed over at most ``window`` times, and with
``p`` requests ahead of it leaves the queue within ``p + 1`` batches (the requeue of a lost slot's batch, which goes
back to the head, adds its size). A request that is not due is never taken while a due one that fits the batch stays
in the window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import islice

from verl_async_rm.batching.request import Request

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
    prefer_siblings: bool = False,
) -> list[Request]:
    """Pick the next batch from ``pending`` (oldest first, ``count`` requests holding ``pending_tokens`` tokens).

    ``due_before``: a request submitted at or before this time has waited ``max_wait``. ``window``: how many requests
    after the oldest one length grouping may choose from. ``prefer_siblings``: take the head's group first (rule 4).
    Returns the oldest request first, at least one request when ``pending`` is not empty, at most ``max_items``, and
    more than one only if their tokens fit ``max_tokens``.
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
    anchor = head.num_tokens
    if not group_by_length or anchor is None:
        for req in it:  # strict FIFO
            n = req.num_tokens or 0
            if max_tokens is not None and tokens + n > max_tokens:
                break  # the deferred request keeps its place and opens the next batch
            batch.append(req)
            tokens += n
            if len(batch) >= max_items:
                break
        return batch

    group = head.group if prefer_siblings else None

    def order(req: Request) -> tuple[bool, bool, float, int]:
        n = req.num_tokens
        sibling = group is not None and req.group == group
        return (req.t_submit > due_before, not sibling, math.inf if n is None else abs(n - anchor), req.seq)

    for req in sorted(islice(it, window), key=order):
        n = req.num_tokens or 0
        if max_tokens is not None and tokens + n > max_tokens:
            continue  # skipped: it keeps its place in the queue
        batch.append(req)
        tokens += n
        if len(batch) >= max_items:
            break
    return batch
