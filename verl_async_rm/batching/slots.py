"""``SlotTable``: which slots (RM replicas) can take a batch, and what happens when one fails as a whole.

A slot is ``free``, ``busy``, ``late`` (its call ran past ``batch_timeout_s`` and was cancelled but has not ended: no
new batch until it has), ``replacing`` or ``lost``. Free slots are taken oldest-freed first.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["SlotTable", "ReplaceFn", "SLOT_STATES"]

logger = logging.getLogger(__name__)

#: ``async replace(slot, index) -> new slot``: start a stand-in for a lost slot; raises if it cannot.
ReplaceFn = Callable[[Any, int], Awaitable[Any]]

SLOT_STATES = ("free", "busy", "late", "replacing", "lost")


class SlotTable:
    """The executor's slots (index ``i`` is passed around, the object goes to ``batch_fn``) and their states;
    ``on_change`` is called (synchronously) whenever a slot becomes free or is lost for good."""

    def __init__(
        self, slots: tuple[Any, ...], *, replace: ReplaceFn | None, on_change: Callable[[], None], name: str
    ) -> None:
        self.slots = list(slots)
        self.state = ["free"] * len(slots)
        self.free: deque[int] = deque(range(len(slots)))
        self._replace = replace
        self._on_change = on_change
        self._name = name
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.counts = Counter(lost=0, replaced=0, replace_failed=0, late=0)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def usable(self) -> int:
        """Slots that are or will be able to take a batch (all but the ``lost`` ones)."""
        return sum(state != "lost" for state in self.state)

    def take(self) -> int:
        """Index of the oldest free slot, now ``busy`` (there must be one)."""
        index = self.free.popleft()
        self.state[index] = "busy"
        return index

    def release(self, index: int) -> None:
        """The slot's batch (or its late call) is over and the slot is fine."""
        self.state[index] = "free"
        self.free.append(index)
        self._on_change()

    def mark_late(self, index: int) -> None:
        """The slot's call was given up on (and cancelled) but has not ended: no batch until :meth:`release`."""
        self.state[index] = "late"
        self.counts["late"] += 1
        logger.warning("executor %r: slot %d gets no batch until its timed-out call has ended", self._name, index)

    def lose(self, index: int, cause: BaseException) -> None:
        """The slot is gone: replace it if a replacement function was given, else retire it."""
        self.counts["lost"] += 1
        if self._replace is None or self._closed:
            logger.error("executor %r: slot %d lost (%s); %d slot(s) left", self._name, index, cause, self.usable - 1)
            self._retire(index)
            return
        logger.warning("executor %r: slot %d lost (%s); starting a replacement", self._name, index, cause)
        self.state[index] = "replacing"
        self._spawn(self._do_replace(index), f"{self._name}-replace-slot-{index}")

    def lose_idle(self, index: int, cause: BaseException) -> bool:
        """A free slot is gone (found between batches): :meth:`lose` it; False (nothing done) when it is not free."""
        if self.state[index] != "free":
            return False
        self.free.remove(index)
        self.lose(index, cause)
        return True

    def summary(self) -> dict[str, int]:
        """How many slots are in each state, and the lost / replaced / late counters."""
        states = Counter(self.state)
        out = {f"slots_{state}": states.get(state, 0) for state in SLOT_STATES}
        out.update({f"slots_{key}_total": value for key, value in self.counts.items()})
        return out

    async def aclose(self) -> None:
        """Stop the replacements under way; slots lost from now on are retired, not replaced."""
        self._closed = True
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    # ------------------------------------------------------------------ internals

    def _retire(self, index: int) -> None:
        self.state[index] = "lost"
        self._on_change()

    async def _do_replace(self, index: int) -> None:
        old = self.slots[index]
        try:
            new = self._replace(old, index)  # type: ignore[misc]
            if inspect.isawaitable(new):
                new = await new
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed replacement retires the slot, it must not crash us
            self.counts["replace_failed"] += 1
            logger.error("executor %r: could not replace slot %d: %s; %d slot(s) left", self._name, index, exc,
                         self.usable - 1)
            self._retire(index)
            return
        self.slots[index] = new
        self.counts["replaced"] += 1
        logger.warning("executor %r: slot %d replaced", self._name, index)
        self.release(index)

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("executor %r: slot task %s failed", self._name, task.get_name(), exc_info=task.exception())

