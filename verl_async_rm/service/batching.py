"""How single requests become batches: the policy (:class:`BatchPolicy`, the ``async_rm.*`` batching keys), the
pending requests in arrival order with their flush rule (:class:`RequestQueue`) and the choice of the next batch
(:func:`select_batch`). Pure data structures: no asyncio loop, no Ray."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from verl_async_rm.options import check_options, option

__all__ = ["BatchPolicy", "Request", "RequestQueue", "select_batch", "PENDING", "RUNNING", "DONE"]

#: Length grouping picks from this many batches' worth of requests after the oldest one (wider groups better under a
#: backlog: padding 0.097 at 4, 0.039 at 16 in the overlap bench). The oldest request is in every batch, so one with
#: p requests ahead of it leaves within p + 1 batches.
_GROUP_WINDOW_BATCHES = 16
#: A timer may fire up to one clock tick early: a request this close to its max_wait counts as due.
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution
PENDING, RUNNING, DONE = 1, 2, 3


@dataclass(frozen=True)
class BatchPolicy:
    """How requests become batches (``async_rm.*`` keys; per RM under ``async_rm.models.<name>``)."""

    max_batch_size: int = option(32, "Most requests in one RM call; a batch this full leaves at once.", least=1,
                                 fix="set it to the most requests one RM call should score, for example 64")
    max_batch_tokens: int | None = option(
        None, "Most policy tokens in one RM call (a longer request goes alone). None: no budget.", int,
        optional=True, least=1, fix="set the token budget of one RM call (e.g. 65536), or None for no budget")
    max_wait_ms: float = option(
        20.0, "A free replica takes what waits once the OLDEST request has waited this long; 0: at once.", least=0,
        fix="set how long the oldest request may wait for a batch to fill (ms), e.g. 20")
    batch_timeout_s: float | None = option(
        600.0, "Longest one RM call may run: then its requests fail (RequestTimeoutError) and the replica takes no "
        "batch until the call ends (replaced if silent init_timeout_s more). None: no limit. Not a remote RM's: its "
        "attempts are bounded by attempt_timeout_s, its requests by request_timeout_s.", float,
        optional=True, above=0, fix="give a positive number of seconds, or None for no limit")
    group_by_length: bool = option(
        True, "Fill a batch (after the oldest request) with the closest lengths, overdue ones first, to cut "
        "padding; False: arrival order.")
    prefer_siblings: bool = option(
        False, "With group_by_length: the oldest request's GRPO siblings first, so a packed RM with share_prompts "
        "computes their prompt once (costs padding on a padded RM).")
    replica_retries: int = option(
        2, "Times a request whose replica died under it goes back to the queue before failing with that error.",
        least=0, fix="use 0 to fail at once, or a small count such as 2")

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0


@dataclass(slots=True, eq=False)
class Request:
    """A caller's item, its future and its state (``PENDING -> RUNNING -> DONE``); ``seq`` orders arrivals."""

    seq: int
    item: Any
    num_tokens: int | None
    t_submit: float
    future: asyncio.Future
    deadline_s: float | None
    group: Any = None  # GRPO siblings share it
    state: int = PENDING
    timer: asyncio.TimerHandle | None = None
    requeued: int = 0


def select_batch(pending: Iterable[Request], *, count: int, pending_tokens: int, max_items: int,
                 max_tokens: int | None, due_before: float, group_by_length: bool, window: int,
                 prefer_siblings: bool = False) -> list[Request]:
    """The next batch from ``pending``, oldest first: the oldest always (alone if over the token budget). In arrival
    order it stops at the first that does not fit; with length grouping the rest comes from the ``window`` after the
    oldest: due ones first, then its siblings (``prefer_siblings``), then the closest lengths."""
    if count <= max_items and (max_tokens is None or pending_tokens <= max_tokens):
        return list(pending)
    it = iter(pending)
    head = next(it, None)
    if head is None:
        return []
    batch, tokens = [head], head.num_tokens or 0
    if max_items == 1 or (max_tokens is not None and tokens >= max_tokens):
        return batch
    grouped = group_by_length and head.num_tokens is not None
    candidates: Iterable[Request] = it
    if grouped:
        anchor, group = head.num_tokens, head.group if prefer_siblings else None

        def order(req: Request) -> tuple[bool, bool, float, int]:
            n = req.num_tokens
            return (req.t_submit > due_before, group is None or req.group != group,
                    math.inf if n is None else abs(n - anchor), req.seq)

        candidates = sorted(islice(it, window), key=order)
    for req in candidates:
        n = req.num_tokens or 0
        if max_tokens is not None and tokens + n > max_tokens:
            if grouped:  # a closer length may still fit
                continue
            break  # arrival order: nothing jumps the queue
        batch.append(req)
        tokens += n
        if len(batch) >= max_items:
            break
    return batch


class RequestQueue:
    """The pending requests in arrival order (O(1) removal anywhere), their token total, the flush rule and the
    taking of the next batch. ``flush_seq``: requests up to this arrival number leave without waiting."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.pending: OrderedDict[int, Request] = OrderedDict()
        self.tokens = 0
        self.flush_seq = 0
        self._policy = policy

    def __len__(self) -> int:
        return len(self.pending)

    def departure(self, now: float) -> tuple[str | None, float | None]:
        """Why the next batch leaves now (``(reason, None)``, a reason of ``FLUSH_REASONS``), else when to look again:
        ``(None, t)``: not before loop time ``t`` unless the queue changes; ``(None, None)``: the queue is empty."""
        pending, policy = self.pending, self._policy
        if not pending:
            return None, None
        if len(pending) >= policy.max_batch_size:
            return "size", None
        if policy.max_batch_tokens is not None and self.tokens >= policy.max_batch_tokens:
            return "tokens", None
        head = next(iter(pending.values()))
        if head.seq <= self.flush_seq:
            return "flush", None
        due = head.t_submit + policy.max_wait_s
        return ("age", None) if now + _CLOCK_RESOLUTION >= due else (None, due)

    def take_batch(self, now: float, free: int) -> list[Request]:
        """The next batch, out of the queue. Requests a flush covers are split evenly over several free replicas,
        whatever flushed them (the step's last request may also fill the batch: it still leaves in parallel)."""
        policy, count = self._policy, len(self.pending)
        max_items, max_tokens = policy.max_batch_size, policy.max_batch_tokens
        if free > 1 and count > 1 and next(iter(self.pending)) <= self.flush_seq:
            share = min(free, count)
            max_items = min(max_items, -(-count // share))
            if self.tokens:
                per_replica = -(-self.tokens // share)
                max_tokens = per_replica if max_tokens is None else min(max_tokens, per_replica)
        picked = select_batch(self.pending.values(), count=count, pending_tokens=self.tokens, max_items=max_items,
                              max_tokens=max_tokens, due_before=now + _CLOCK_RESOLUTION - policy.max_wait_s,
                              group_by_length=policy.group_by_length,
                              window=_GROUP_WINDOW_BATCHES * policy.max_batch_size,
                              prefer_siblings=policy.prefer_siblings)
        for req in picked:
            self.remove(req)
        return picked

    def put(self, req: Request) -> None:
        req.state = PENDING
        self.pending[req.seq] = req
        if req.num_tokens:
            self.tokens += req.num_tokens

    def remove(self, req: Request) -> None:
        del self.pending[req.seq]
        if req.num_tokens:
            self.tokens -= req.num_tokens

    def requeue(self, reqs: list[Request]) -> None:
        """Back at the head of the queue, in arrival order."""
        for req in sorted(reqs, key=lambda r: r.seq, reverse=True):
            self.put(req)
            self.pending.move_to_end(req.seq, last=False)

    def clear(self) -> list[Request]:
        waiting = list(self.pending.values())
        self.pending.clear()
        self.tokens = 0
        return waiting

