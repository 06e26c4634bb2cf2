"""The group gate (``service/group_gate.py``), on a virtual clock with a judge of the test's own: a complete group makes
one judge call and each member gets its own score; a short group is judged with the members it has once the wait has
passed since its last arrival; a judge's error (a reply that does not read, after the RM service's re-asks) reaches
every member; a member that gives up (cancelled, or past its deadline) leaves its group and the others are judged
without it, as they are once a sibling that will never come is withdrawn; every member resolves exactly once."""

from __future__ import annotations

import asyncio
import random

import pytest

from verl_async_rm.errors import AsyncRMError, BatcherClosedError, JudgeVerdictError, RequestTimeoutError
from verl_async_rm.request import GroupVerdict, RMRequest, Verdict
from verl_async_rm.service.group_gate import GroupGate
from verl_async_rm.service.metrics import group_metrics
from verl_async_rm.testing.batcher import run_virtual

pytestmark = pytest.mark.unit

WAIT_S = 30.0


def member(group: str, i: int, size: int | None = 3) -> RMRequest:
    return RMRequest(uid=f"{group}/{i}", prompt_ids=[1, 2], response_ids=[3, 4 + i], group=group, group_size=size)


def score_of(request: RMRequest) -> float:
    """The number the test's judge gives a member: its session index."""
    return float(request.uid.rsplit("/", 1)[1])


class Judge:
    """Scores each member by :func:`score_of`; ``replies`` (optional): what each call returns instead (a callable of
    the group, or a value); ``gate``: an event each call waits on."""

    def __init__(self, replies=(), gate: asyncio.Event | None = None) -> None:
        self.calls: list = []
        self.replies, self.gate = list(replies), gate

    async def __call__(self, group, deadline_s):
        self.calls.append(group)
        if self.gate is not None:
            await self.gate.wait()
        if self.replies:
            reply = self.replies.pop(0)
            return reply(group) if callable(reply) else reply
        return GroupVerdict(tuple(score_of(m) for m in group.members),
                            tuple(f"[{label}] {{}}" for label in range(1, len(group.members) + 1)))


def test_a_complete_group_makes_one_judge_call_and_each_member_gets_its_own_score():
    async def main():
        judge = Judge()
        gate = GroupGate(judge, wait_s=WAIT_S)
        results = await asyncio.gather(*(gate.submit(member("g", i)) for i in (2, 0, 1)),
                                       *(gate.submit(member("h", i, 2)) for i in (5, 7)))
        return judge.calls, results, gate.pop_step_stats()

    calls, results, stats = run_virtual(main)
    assert [len(c.members) for c in calls] == [3, 2] and [c.group for c in calls] == ["g", "h"]
    assert [r.score for r in results] == [2.0, 0.0, 1.0, 5.0, 7.0] and all(isinstance(r, Verdict) for r in results)
    assert results[0].text.startswith("[1] ")  # the member's label, then the judge's reply
    figures = group_metrics(stats)
    assert (figures["requests"], figures["scored"], figures["errors"]) == (5, 5, 0)
    assert (figures["groups_judged"], figures["groups_partial"]) == (2, 0)


def test_a_short_group_is_judged_with_its_members_once_the_wait_has_passed_since_its_last_arrival():
    async def main():
        loop = asyncio.get_running_loop()
        judge = Judge()
        gate = GroupGate(judge, wait_s=WAIT_S)
        first = asyncio.ensure_future(gate.submit(member("g", 0, 4)))
        await asyncio.sleep(20.0)
        second = asyncio.ensure_future(gate.submit(member("g", 1, 4)))
        arrived = loop.time()
        await asyncio.sleep(WAIT_S - 1.0)  # 49 s after the first, 29 s after the last: still waiting
        assert not first.done() and judge.calls == []
        results = await asyncio.gather(first, second)
        return judge.calls, results, loop.time() - arrived, gate.pop_step_stats()

    calls, results, waited, stats = run_virtual(main)
    assert [len(c.members) for c in calls] == [2] and [r.score for r in results] == [0.0, 1.0]
    assert waited == pytest.approx(WAIT_S)
    figures = group_metrics(stats)
    assert figures["groups_partial"] == 1 and figures["group_wait_s/p50"] == pytest.approx(20.0 + WAIT_S)


def test_a_withdrawn_sibling_lets_its_group_be_judged_when_the_rest_are_in_and_an_all_withdrawn_group_is_dropped():
    async def main():
        loop = asyncio.get_running_loop()
        judge = Judge()
        gate = GroupGate(judge, wait_s=WAIT_S)
        gate.withdraw("g", 3)  # before any sibling is in: its agent loop failed first
        first = asyncio.ensure_future(gate.submit(member("g", 0)))
        await asyncio.sleep(5.0)
        second = asyncio.ensure_future(gate.submit(member("g", 1)))
        results = await asyncio.gather(first, second)  # 2 in + 1 withdrawn: judged at once
        judged_after = loop.time() - 5.0
        third = asyncio.ensure_future(gate.submit(member("h", 0, 2)))
        await asyncio.sleep(1.0)
        gate.withdraw("h", 2)  # after a sibling is in
        alone = await third
        for _ in range(3):  # every member of "k" withdrawn: no judge call, nothing left open
            gate.withdraw("k", 3)
        return judge.calls, results, judged_after, alone, gate.stats(), gate.pop_step_stats()

    calls, results, judged_after, alone, open_now, stats = run_virtual(main)
    assert judged_after == pytest.approx(0.0)  # not WAIT_S after the last arrival
    assert [c.group for c in calls] == ["g", "h"] and [len(c.members) for c in calls] == [2, 1]
    assert [r.score for r in results] == [0.0, 1.0] and alone.score == 0.0
    assert open_now["open_groups"] == 0 and open_now["waiting_members"] == 0
    assert (stats.requests, stats.scored, stats.groups, stats.partial) == (3, 3, 2, 2)


def test_a_withdrawal_alone_opens_nothing_that_outlives_the_wait():
    async def main():
        gate = GroupGate(Judge(), wait_s=WAIT_S)
        gate.withdraw("g", 3)  # its siblings never come either (their step was cancelled)
        await asyncio.sleep(WAIT_S + 1.0)
        return gate.stats()

    assert run_virtual(main)["open_groups"] == 0


def test_a_member_after_its_groups_judging_starts_the_group_again_and_one_without_a_size_waits():
    async def main():
        judge = Judge()
        gate = GroupGate(judge, wait_s=WAIT_S)
        early = await asyncio.gather(gate.submit(member("g", 0, 2)), gate.submit(member("g", 1, 2)))
        late = await gate.submit(member("g", 2, 2))  # a third sibling: alone, judged after the wait
        unsized = await asyncio.gather(gate.submit(member("u", 0, None)), gate.submit(member("u", 1, None)))
        return judge.calls, early, late, unsized

    calls, early, late, unsized = run_virtual(main)
    assert [len(c.members) for c in calls] == [2, 1, 2]
    assert [r.score for r in (*early, late, *unsized)] == [0.0, 1.0, 2.0, 0.0, 1.0]


def test_a_judges_error_reaches_every_member_with_the_reply():
    def bad(group):
        return JudgeVerdictError(f"{group.uid}: the judge's reply does not read: no JSON object ('nothing')",
                                 reply="nothing", reason="there is no JSON object in it")

    async def main():
        judge = Judge([bad])
        gate = GroupGate(judge, wait_s=WAIT_S)
        results = await asyncio.gather(*(gate.submit(member("g", i)) for i in range(3)))
        return judge.calls, results, gate.pop_step_stats()

    calls, results, stats = run_virtual(main)
    assert len(calls) == 1 and calls[0].reask is None
    assert all(isinstance(r, JudgeVerdictError) and r.reply == "nothing" and "'nothing'" in str(r) for r in results)
    assert (stats.groups, stats.scored, stats.errors) == (1, 0, 3)


def test_a_judge_that_raises_fails_every_member_and_the_gate_keeps_serving():
    async def main():
        judge = Judge([lambda group: 1 / 0])
        gate = GroupGate(judge, wait_s=WAIT_S)
        failed = await asyncio.gather(*(gate.submit(member("g", i, 2)) for i in range(2)))
        again = await asyncio.gather(*(gate.submit(member("h", i, 2)) for i in range(2)))
        return failed, again

    failed, again = run_virtual(main)
    assert all(isinstance(r, AsyncRMError) and "ZeroDivisionError" in str(r) for r in failed)
    assert [r.score for r in again] == [0.0, 1.0]


def test_a_cancelled_member_leaves_its_open_group_and_the_others_are_judged_when_the_rest_arrive():
    async def main():
        judge = Judge()
        gate = GroupGate(judge, wait_s=WAIT_S)
        a = asyncio.ensure_future(gate.submit(member("g", 0)))
        b = asyncio.ensure_future(gate.submit(member("g", 1)))
        await asyncio.sleep(1.0)
        a.cancel()
        c = asyncio.ensure_future(gate.submit(member("g", 2)))  # the third arrival: complete, without a
        results = await asyncio.gather(b, c)
        with pytest.raises(asyncio.CancelledError):
            await a
        return judge.calls, results, gate.pop_step_stats()

    calls, results, stats = run_virtual(main)
    assert [[m.uid for m in c.members] for c in calls] == [["g/1", "g/2"]]
    assert [r.score for r in results] == [1.0, 2.0] and stats.partial == 1 and stats.requests == 3


def test_a_member_cancelled_while_its_group_is_judged_does_not_lose_the_others():
    async def main():
        release = asyncio.Event()
        judge = Judge(gate=release)
        gate = GroupGate(judge, wait_s=WAIT_S)
        tasks = [asyncio.ensure_future(gate.submit(member("g", i))) for i in range(3)]
        await asyncio.sleep(1.0)
        assert len(judge.calls) == 1
        tasks[1].cancel()
        await asyncio.sleep(1.0)
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, gate.pop_step_stats()

    results, stats = run_virtual(main)
    assert results[0].score == 0.0 and results[2].score == 2.0 and isinstance(results[1], asyncio.CancelledError)
    assert (stats.scored, stats.errors) == (2, 0)


def test_past_its_deadline_a_member_fails_alone_and_leaves_its_group():
    async def main():
        judge = Judge()
        gate = GroupGate(judge, wait_s=WAIT_S)
        early = await gate.submit(member("g", 0, 2), deadline_s=5.0)
        rest = await gate.submit(member("g", 1, 2), deadline_s=60.0)  # the second arrival completes the group
        return judge.calls, early, rest

    calls, early, rest = run_virtual(main)
    assert isinstance(early, RequestTimeoutError) and "missed its deadline of 5 s" in str(early)
    assert [[m.uid for m in c.members] for c in calls] == [["g/1"]] and rest.score == 1.0


def test_closing_fails_the_members_of_open_groups_and_running_judge_calls_after_the_grace():
    async def main():
        release = asyncio.Event()
        judge = Judge(gate=release)
        gate = GroupGate(judge, wait_s=WAIT_S)
        judged = [asyncio.ensure_future(gate.submit(member("g", i, 2))) for i in range(2)]
        waiting = asyncio.ensure_future(gate.submit(member("h", 0, 2)))
        await asyncio.sleep(1.0)
        await gate.aclose(grace_s=5.0)
        after = await gate.submit(member("k", 0, 1))
        return await asyncio.gather(*judged, waiting), after

    results, after = run_virtual(main)
    assert all(isinstance(r, BatcherClosedError) for r in (*results, after))
    assert "while group h waited" in str(results[2]) and "while group g" in str(results[0])


def test_every_member_resolves_exactly_once_under_random_arrivals_failures_and_cancellations():
    rng = random.Random(0)

    def reply(group):
        roll = rng.random()
        if roll < 0.2:
            return JudgeVerdictError("unreadable", reply="x", reason="no JSON object")
        if roll < 0.3:
            raise RuntimeError("judge bug")
        return GroupVerdict(tuple(score_of(m) for m in group.members),
                            tuple(f"[{label}] {{}}" for label in range(1, len(group.members) + 1)))

    async def main():
        judge = Judge([reply] * 10_000)
        gate = GroupGate(judge, wait_s=WAIT_S)
        tasks = []
        for i in range(400):
            group, size = f"g{rng.randrange(80)}", rng.choice([None, 2, 4, 8])
            tasks.append(asyncio.ensure_future(gate.submit(member(group, i, size),
                                                           deadline_s=rng.choice([None, 50.0]))))
            await asyncio.sleep(rng.expovariate(1.0))
            if rng.random() < 0.1:
                rng.choice(tasks).cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 3600.0)
        return tasks, results, gate.pop_step_stats(), gate.stats()

    tasks, results, stats, live = run_virtual(main)
    cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert stats.requests == len(tasks) == stats.scored + stats.errors + cancelled
    assert min(stats.scored, stats.errors, cancelled, stats.partial) > 0, stats
    for i, result in enumerate(results):
        assert isinstance(result, Verdict | AsyncRMError | asyncio.CancelledError), result
        assert not isinstance(result, Verdict) or result.score == i  # its own session's number
    assert live == {"open_groups": 0, "waiting_members": 0, "judging_groups": 0, "closed": False}
