"""``WaitingRoom``: the requests that wait for a batch, in arrival order, and those blocked on a full queue.

PENDING requests live in an ordered dict keyed by arrival number (O(1) removal anywhere, for cancellations and
deadlines, and O(1) access to the oldest). With ``max_pending`` and ``overflow='block'``, requests beyond it are
BLOCKED in a FIFO and admitted, oldest first, as room frees up; once any request is blocked every new one queues
behind it, so arrival order is kept end to end.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from verl_async_rm.executor.request import BLOCKED, PENDING, Request

__all__ = ["WaitingRoom"]


class WaitingRoom:
    """Pending and blocked requests, with the pending requests' token total kept up to date."""

    __slots__ = ("pending", "tokens", "blocked", "_overflow", "_max_pending")

    def __init__(self, max_pending: int | None) -> None:
        self.pending: OrderedDict[int, Request] = OrderedDict()
        self.tokens = 0  # sum of num_tokens over pending requests
        self.blocked = 0  # BLOCKED requests (the overflow FIFO may also hold settled ones, skipped when popped)
        self._overflow: deque[Request] = deque()
        self._max_pending = max_pending

    def __len__(self) -> int:
        return len(self.pending)

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

    def head(self) -> Request:
        """The oldest pending request (the queue must not be empty)."""
        return next(iter(self.pending.values()))

    def take(self, req: Request) -> None:
        """Remove a pending request that goes into a batch (call :meth:`admit` once the batch is taken)."""
        del self.pending[req.seq]
        if req.num_tokens:
            self.tokens -= req.num_tokens

    def remove(self, req: Request) -> None:
        """Remove a waiting request that is being settled (cancelled, expired); admits blocked ones into its room."""
        if req.state == PENDING:
            self.take(req)
            if self.blocked:
                self.admit()
        elif req.state == BLOCKED:
            self.blocked -= 1

    def requeue(self, reqs: list[Request]) -> None:
        """Put requests taken for a batch back at the head of the queue, in arrival order (room limits do not apply:
        they were admitted once)."""
        for req in sorted(reqs, key=lambda r: r.seq, reverse=True):
            self.put(req)
            self.pending.move_to_end(req.seq, last=False)

    def admit(self) -> int:
        """Move blocked requests into the queue while there is room, oldest first; returns how many moved."""
        moved = 0
        overflow = self._overflow
        while overflow and (self._max_pending is None or len(self.pending) < self._max_pending):
            req = overflow.popleft()
            if req.state != BLOCKED:
                continue  # settled while blocked
            self.blocked -= 1
            self.put(req)
            moved += 1
        return moved

    def clear(self) -> list[Request]:
        """Empty the room; returns every request that was waiting (pending first, then blocked)."""
        waiting = list(self.pending.values()) + [r for r in self._overflow if r.state == BLOCKED]
        self.pending.clear()
        self._overflow.clear()
        self.tokens = self.blocked = 0
        return waiting
