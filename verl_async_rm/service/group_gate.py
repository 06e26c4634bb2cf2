"""The group gate of a group or pairwise judge's RM service (``reward_kind='group_judge'`` or ``'pairwise_judge'``;
pure asyncio, no Ray): a trajectory's request is held until its group (verl's prompt ``uid``, ``RMRequest.group``) has
``group_size`` members (``rollout.n``), then the group is judged (one judge call, or its comparisons) and each member
gets its own score. Other groups keep flowing: each group is judged the moment it is complete.

- **Partial groups.** A sibling that will never come (its agent loop failed, or scored itself) is withdrawn by its
  worker (:meth:`GroupGate.withdraw`): its group is judged as soon as the rest have arrived. A group that stays short
  otherwise is judged with the members it has once ``wait_s`` has passed since its last member arrived; a request
  without ``group_size`` is judged that way too. Never a stand-in score: each member gets the judge's score for its own
  response, or an error. A member that arrives after its group was judged starts its group again (judged with the other
  late members). Open groups are not judged at a step's end: in verl's async trainer modes the next batch's groups are
  filling then, and in the sync ones no group can be open at a step's end, since its members' trajectories hold the
  step.
- **One judging per group.** ``judge`` scores the group (the RM service asks again while a reply does not read);
  every member gets its own score from the :class:`GroupVerdict`, or the error.
- **Bounds.** A member waits at most its ``deadline_s`` (``RequestTimeoutError``), and leaves its group then, as a
  member whose caller gives up (cancelled) does; the others are judged without it, as soon as the rest have arrived.
  The judge call runs until the latest deadline of the members it scores. Every member resolves exactly once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from verl_async_rm.errors import AsyncRMError, BatcherClosedError, BatchResultError, RequestTimeoutError
from verl_async_rm.percentiles import Samples
from verl_async_rm.request import GroupRequest, GroupVerdict, RMRequest, ScoreResult, Verdict
from verl_async_rm.step_counter import StepCounter

logger = logging.getLogger(__name__)

__all__ = ["GroupGate", "GroupStats", "JudgeFn"]

#: ``async judge(group, deadline_s) -> GroupVerdict or the error`` (as a value): one call of the judge for one group;
#: ``deadline_s``: seconds left for it (None: no deadline).
JudgeFn = Callable[[GroupRequest, "float | None"], Awaitable[ScoreResult]]


_COUNTS = ("requests", "scored", "errors", "groups", "partial")


@dataclass
class GroupStats:
    """One step's stats of the gate (:meth:`GroupGate.pop_step_stats`): trajectories in and their outcome (each
    counted once), groups judged (``partial``: with fewer members than their ``group_size``), the wait from a group's
    first member to its judging (seconds), and ``tail_s``: from the step's last trajectory in to its last score out."""

    requests: int = 0
    scored: int = 0
    errors: int = 0
    groups: int = 0
    partial: int = 0
    wait_s: Samples = field(default_factory=Samples)
    last_submit: float | None = None
    last_result: float | None = None

    @property
    def tail_s(self) -> float | None:
        if self.last_submit is None or self.last_result is None or self.last_result < self.last_submit:
            return None
        return self.last_result - self.last_submit


@dataclass
class _Member:
    request: RMRequest
    future: asyncio.Future
    deadline: float | None  #: loop time; None: none


@dataclass
class _Group:
    key: str
    size: int | None
    first: float
    members: list[_Member] = field(default_factory=list)
    arrivals: int = 0  #: members arrived, and members withdrawn (they will never come)
    timer: asyncio.TimerHandle | None = None


class GroupGate:
    """Holds the members of each group until it is complete (or ``wait_s`` after its last arrival), then scores it
    with one ``judge`` call (see the module doc). Binds to the event loop of its first :meth:`submit`."""

    def __init__(self, judge: JudgeFn, *, wait_s: float, name: str = "group_gate") -> None:
        if not wait_s > 0:
            raise ValueError(f"wait_s must be > 0 seconds, got {wait_s!r}")
        self._judge, self._wait_s, self._name = judge, float(wait_s), name
        self._open: dict[str, _Group] = {}
        self._tasks: set[asyncio.Task] = set()
        self._counts = StepCounter(_COUNTS)
        self._wait = Samples()
        self._last_submit: float | None = None
        self._last_result: float | None = None
        self._closed = False

    async def submit(self, request: RMRequest, deadline_s: float | None = None) -> ScoreResult:
        """Hold ``request`` until its group is judged: its score (a group judge's number for its label over
        ``judge_scale``, a pairwise judge's aggregate) or the error that kept it from being scored, as a value.
        ``deadline_s``: seconds from now (None: none)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._counts.add("requests")
        self._last_submit = now
        if self._closed:
            return self._result(BatcherClosedError(f"{self._name}: the RM service is closed; it scores no new "
                                                   "trajectory"))
        key = request.group if request.group is not None else f"\0{request.uid}"  # no group: judged alone
        group = self._arrive(key, request.group_size if request.group is not None else 1)
        member = _Member(request, loop.create_future(), None if deadline_s is None else now + deadline_s)
        group.members.append(member)
        self._close_or_wait(group)
        try:
            done, _ = await asyncio.wait({member.future}, timeout=deadline_s)
        except asyncio.CancelledError:  # the caller gave up: it leaves its group; the others go on
            self._leave(member, group)
            raise
        if not done:
            self._leave(member, group)
            return self._result(RequestTimeoutError(
                f"{self._name}: trajectory {request.uid} missed its deadline of {deadline_s:g} s waiting for its group "
                f"{request.group} ({group.arrivals} of {group.size or '?'} arrived) or its judge call"))
        return self._result(member.future.result())

    def withdraw(self, group: str, group_size: int | None) -> None:
        """A member of ``group`` will never come (its agent loop failed, or scored itself): the group is judged as
        soon as the others have arrived, not ``wait_s`` after the last of them. A group left with no member is
        dropped, never judged."""
        if not self._closed:
            self._close_or_wait(self._arrive(group, group_size))

    def _arrive(self, key: str, size: int | None) -> _Group:
        """The open group ``key`` (opened now if none is), one more of its members counted."""
        group = self._open.get(key)
        if group is None:
            group = self._open[key] = _Group(key, size, asyncio.get_running_loop().time())
        group.arrivals += 1
        return group

    def _close_or_wait(self, group: _Group) -> None:
        """Judge ``group`` now if every member is in, else (again) ``wait_s`` from now."""
        if group.size is not None and group.arrivals >= group.size:
            self._close(group)
            return
        if group.timer is not None:
            group.timer.cancel()
        group.timer = asyncio.get_running_loop().call_later(self._wait_s, self._close, group)

    def pop_step_stats(self) -> GroupStats:
        """Figures since the previous call (or the start); starts a new step."""
        submit, result, self._last_submit, self._last_result = self._last_submit, self._last_result, None, None
        wait, self._wait = self._wait, Samples()
        return GroupStats(**{name: int(n) for name, n in self._counts.pop_step().items()}, wait_s=wait,
                          last_submit=submit, last_result=result)

    def stats(self) -> dict[str, Any]:
        """What waits now: open groups, their members, judge calls running."""
        return {"open_groups": len(self._open), "waiting_members": sum(len(g.members) for g in self._open.values()),
                "judging_groups": len(self._tasks), "closed": self._closed}

    async def aclose(self, grace_s: float = 10.0) -> None:
        """Stop (idempotent): members of open groups fail with :class:`BatcherClosedError`; judge calls running get
        ``grace_s``, then are cancelled and their members fail alike."""
        if self._closed:
            return
        self._closed = True
        groups, self._open = list(self._open.values()), {}
        for group in groups:
            if group.timer is not None:
                group.timer.cancel()
            self._fan_out(group.members, BatcherClosedError(
                f"{self._name}: the RM service was closed while group {group.key} waited for its members"))
        tasks = set(self._tasks)
        if tasks and grace_s > 0:
            _, tasks = await asyncio.wait(tasks, timeout=grace_s)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    def _close(self, group: _Group) -> None:
        """Start judging ``group`` with the members still waiting (complete, or its wait is over)."""
        if self._open.get(group.key) is not group:
            return
        del self._open[group.key]
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None
        members = [m for m in group.members if not m.future.done()]
        if not members:
            return
        loop = asyncio.get_running_loop()
        self._counts.add("groups")
        self._counts.add("partial", group.size is None or len(members) < group.size)
        self._wait.add(loop.time() - group.first)
        task = loop.create_task(self._judge_group(group.key, members), name=f"{self._name}-judge-{group.key}")
        self._tasks.add(task)
        task.add_done_callback(self._judged)

    async def _judge_group(self, key: str, members: list[_Member]) -> None:
        """The judging of ``members`` (until the latest of their deadlines), then each member's result."""
        request = GroupRequest(key, tuple(m.request for m in members))
        result: Any = None
        try:
            result = await self._judge(request, self._time_left(members))
        except asyncio.CancelledError:
            result = BatcherClosedError(f"{self._name}: the RM service was closed while {request.uid} was judged")
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not strand a member
            logger.error("%s: judging %s failed unexpectedly", self._name, request.uid, exc_info=exc)
            result = AsyncRMError(f"{self._name}: judging {request.uid} failed: {exc!r}")
            result.__cause__ = exc
        finally:
            self._fan_out(members, result)

    def _fan_out(self, members: list[_Member], result: Any) -> None:
        """Each member still waiting gets its own result: its score from a :class:`GroupVerdict`, or the error."""
        if isinstance(result, GroupVerdict) and len(result.scores) != len(members):
            result = BatchResultError(f"{self._name}: the judge returned {len(result.scores)} scores for a group of "
                                      f"{len(members)}")
        for i, member in enumerate(members):
            if member.future.done():
                continue
            if isinstance(result, GroupVerdict):
                score = result.scores[i]
                member.future.set_result(score if isinstance(score, BaseException) else Verdict(score, result.texts[i]))
            elif isinstance(result, BaseException):
                member.future.set_result(result)
            else:
                member.future.set_result(BatchResultError(f"{self._name}: the judge returned {type(result).__name__}, "
                                                          "not a GroupVerdict or an error"))

    def _leave(self, member: _Member, group: _Group) -> None:
        """``member`` no longer waits (cancelled or past its deadline): out of its group if not judged yet."""
        if not member.future.done():
            member.future.cancel()
        if self._open.get(group.key) is group and member in group.members:
            group.members.remove(member)

    def _time_left(self, members: list[_Member]) -> float | None:
        """Seconds until the latest deadline of the members still waiting (None: one has none)."""
        deadlines = [m.deadline for m in members if not m.future.done()]
        if not deadlines or None in deadlines:
            return None
        return max(deadlines) - asyncio.get_running_loop().time()  # type: ignore[type-var]

    def _result(self, result: ScoreResult) -> ScoreResult:
        self._last_result = asyncio.get_running_loop().time()
        self._counts.add("errors" if isinstance(result, BaseException) else "scored")
        return result

    def _judged(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # members resolved in the finally; log regardless
            logger.error("%s: a judge task failed", self._name, exc_info=task.exception())
