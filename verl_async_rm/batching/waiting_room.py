"""``WaitingRoom``: the requests that wait for a batch, the flush rule (written once: the loop asks it both whether
to form a batch now and until when it may sleep), and taking the next batch out.

PENDING requests live in an ordered dict keyed by arrival number (O(1) removal anywhere, O(1) oldest). Requests beyond
``max_pending`` (``overflow='block'``) wait BLOCKED in a FIFO; once one is blocked every new one queues behind it, so
arrival order is kept end to end.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from verl_async_rm.batching.formation import select_batch
from verl_async_rm.batching.request import BLOCKED, PENDING, Request
from verl_async_rm.batching.policy import BatchPolicy

__all__ = ["WaitingRoom"]

#: Length grouping picks from at most this many batches' worth of requests after the oldest one. Wider groups better
#: under a backlog (overlap bench, 4096 trajectories on 1 replica: padding 0.097 at 4, 0.039 at 16) and costs no
#: fairness: the oldest request is in every batch, so a request with p ahead of it leaves within p + 1 batches.
_GROUP_WINDOW_BATCHES = 16
#: A timer may fire up to one clock tick early: a request this close to its max_wait counts as due.
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution


class WaitingRoom:
    """Pending and blocked requests, the pending requests' token total, and the latest drain mark."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.pending: OrderedDict[int, Request] = OrderedDict()
        self.tokens = 0  # sum of num_tokens over pending requests
        self.blocked = 0  # BLOCKED requests (the overflow FIFO may also hold settled ones, skipped when popped)
        self.drain_seq = 0  # pending requests with seq <= this flush without waiting...
        self.drain_reason = "drain"  # ...for this reason ("drain" or "expect")
        self._overflow: deque[Request] = deque()
        self._policy = policy
        self._max_pending = policy.max_pending
        self._max_items = policy.max_batch_size
        self._max_tokens = policy.max_batch_tokens
        self._max_wait_s = policy.max_wait_s

    def __len__(self) -> int:
        return len(self.pending)

    def next_flush(self, now: float) -> tuple[str | None, float | None]:
        """The flush rule, at loop time ``now``: ``(reason, None)`` to form a batch now (a reason of
        ``stats.FLUSH_REASONS``), ``(None, t)`` not before loop time ``t`` unless the queue changes, ``(None, None)``
        nothing to wait for (the queue is empty)."""
        pending = self.pending
        if not pending:
            return None, None
        if len(pending) >= self._max_items:
            return "size", None
        if self._max_tokens is not None and self.tokens >= self._max_tokens:
            return "tokens", None
        head = next(iter(pending.values()))
        if head.seq <= self.drain_seq:
            return self.drain_reason, None
        due = head.t_submit + self._max_wait_s
        if now + _CLOCK_RESOLUTION >= due:
            return "age", None
        return None, due

    def take_batch(self, reason: str, now: float, free_slots: int) -> list[Request]:
        """Take the next batch out of the queue (see :func:`select_batch`) and admit blocked requests into its room.

        A drain with several free slots is spread evenly over them instead of filling the first one.
        """
        policy, count = self._policy, len(self.pending)
        max_items, max_tokens = self._max_items, self._max_tokens
        if reason in ("drain", "expect") and free_slots > 1 and count > 1:
            share = min(free_slots, count)
            max_items = min(max_items, -(-count // share))
            if self.tokens:
                per_slot = -(-self.tokens // share)
                max_tokens = per_slot if max_tokens is None else min(max_tokens, per_slot)
        picked = select_batch(
            self.pending.values(), count=count, pending_tokens=self.tokens, max_items=max_items,
            max_tokens=max_tokens, due_before=now + _CLOCK_RESOLUTION - self._max_wait_s,
            group_by_length=policy.group_by_length, window=_GROUP_WINDOW_BATCHES * self._max_items,
            prefer_siblings=policy.prefer_siblings,
        )
        for req in picked:
            self._take(req)
        if self.blocked:
            self._admit()
        return picked

    def full(self) -> bool:
        """Whether a new request must be blocked (or rejected) instead of queued."""
        return self._max_pending is not None and (self.blocked > 0 or len(self.pending) >= self._max_pending)

    def put(self, req: Request) -> None:
        req.state = PENDING
        self.pending[req.seq] = req
        if req.num_tokens:
            self.tokens += req.num_tokens

    def put_blocked(self, req: Request) -> None:
        req.state = BLOCKED
        self._overflow.append(req)
        self.blocked += 1

    def remove(self, req: Request) -> None:
        """Remove a waiting request that is being settled (cancelled, expired); admits blocked ones into its room."""
        if req.state == PENDING:
            self._take(req)
            if self.blocked:
                self._admit()
        elif req.state == BLOCKED:
            self.blocked -= 1

    def requeue(self, reqs: list[Request]) -> None:
        """Put requests taken for a batch back at the head of the queue, in arrival order (room limits do not apply:
        they were admitted once)."""
        for req in sorted(reqs, key=lambda r: r.seq, reverse=True):
            self.put(req)
            self.pending.move_to_end(req.seq, last=False)

    def clear(self) -> list[Request]:
        """Empty the room; returns every request that was waiting (pending first, then blocked)."""
        waiting = list(self.pending.values()) + [r for r in self._overflow if r.state == BLOCKED]
        self.pending.clear()
        self._overflow.clear()
        self.tokens = self.blocked = 0
        return waiting

    def _take(self, req: Request) -> None:
        del self.pending[req.seq]
        if req.num_tokens:
            self.tokens -= req.num_tokens

    def _admit(self) -> None:
        """Move blocked requests into the queue while there is room, oldest first."""
        overflow = self._overflow
        while overflow and (self._max_pending is None or len(self.pending) < self._max_pending):
            req = overflow.popleft()
            if req.state == BLOCKED:  # else settled while blocked
                self.blocked -= 1
                self.put(req)
