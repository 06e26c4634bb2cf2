"""One submitted request and the states it moves through (``BLOCKED -> PENDING -> RUNNING -> DONE``)."""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Request", "BLOCKED", "PENDING", "RUNNING", "DONE", "check_tokens", "normalise_slots"]

#: Waiting for room in the queue (``max_pending`` reached, ``overflow='block'``).
BLOCKED = 0
#: In the queue, waiting to be put in a batch.
PENDING = 1
#: In a batch that is running; a result that arrives after the request is DONE is dropped.
RUNNING = 2
#: Resolved exactly once: result, exception, timeout or cancellation.
DONE = 3


@dataclass(slots=True, eq=False)
class Request:
    """A caller's item, its future and its bookkeeping. ``seq`` orders requests by arrival."""

    seq: int
    item: Any
    num_tokens: int | None
    t_submit: float
    future: asyncio.Future
    deadline_s: float | None
    group: Any = None  # siblings (e.g. GRPO responses to one prompt) share it; None: no group
    state: int = PENDING
    timer: asyncio.TimerHandle | None = None
    requeued: int = 0  # times put back in the queue because its slot was lost under it

    def __repr__(self) -> str:
        state = ("BLOCKED", "PENDING", "RUNNING", "DONE")[self.state]
        return f"Request(seq={self.seq}, state={state}, num_tokens={self.num_tokens})"


def normalise_slots(slots: int | Sequence[Any]) -> tuple[Any, ...]:
    """The executor's ``slots`` argument as a tuple of slot objects (an int N becomes ``0..N-1``)."""
    if isinstance(slots, bool):
        raise TypeError(f"slots must be an int or a sequence of slot objects, got {slots!r}")
    if isinstance(slots, int):
        if slots < 1:
            raise ValueError(f"slots={slots}: need at least one slot (one per RM replica, or 1 for a sharded RM)")
        return tuple(range(slots))
    if isinstance(slots, (str, bytes)) or not isinstance(slots, Sequence):
        raise TypeError(f"slots must be an int or a sequence of slot objects (e.g. RM replica handles), got {slots!r}")
    if not slots:
        raise ValueError("slots is empty: give at least one slot (one per RM replica, or 1 for a sharded RM)")
    return tuple(slots)


def check_tokens(num_tokens: Any) -> int:
    """``submit``'s ``num_tokens`` as a non-negative int (numpy integers accepted)."""
    if num_tokens.__class__ is not int:
        if isinstance(num_tokens, bool):
            raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}")
        try:
            num_tokens = operator.index(num_tokens)
        except TypeError:
            raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}") from None
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return num_tokens
