"""A pairwise judge's group (``reward_kind='pairwise_judge'``), judged by the RM service: the comparisons its plan
asks (``pair_plan``, ``pair_orders``), each one item of the service's batcher (asked again, like any judge's reply,
while it does not read), and the answers turned into one reward per response (``pair_aggregate``; the math:
:mod:`verl_async_rm.scoring.pairwise`). A failed comparison leaves the group with the others; a response left with no
comparison answered, or outside the part of a ``bradley_terry`` graph that is scored, fails alone with the reason.
Never a made-up score."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from verl_async_rm.errors import AsyncRMError, RewardModelError
from verl_async_rm.request import GroupRequest, GroupVerdict, ScoreResult
from verl_async_rm.scoring import pairwise
from verl_async_rm.step_counter import StepCounter

__all__ = ["judge_pairs", "PAIR_COUNTS", "pair_metrics"]

#: A step's counts of the comparisons (:func:`pair_metrics` makes the rates).
PAIR_COUNTS = ("comparisons", "comparisons_failed", "ties", "flipped", "both_orders", "cyclic", "triples")

Ask = Callable[[GroupRequest, "float | None"], Awaitable[ScoreResult]]


async def judge_pairs(group: GroupRequest, ask: Ask, rm: Any, deadline_s: float | None,
                      counts: StepCounter) -> GroupVerdict:
    """Each member's reward from the comparisons of ``group`` (``ask``: one ordered pair's P(first wins), or its
    error, through the batcher), in the members' order; the step's comparisons counted in ``counts``."""
    order = sorted(range(len(group.members)), key=lambda i: group.members[i].uid)  # stable, whatever the arrival
    members = [group.members[i] for i in order]
    n = len(members)
    plan = rm.pair_plan or pairwise.default_plan(n)
    pairs = pairwise.plan_pairs(n, plan, k=rm.pair_k, group=group.group, seed=rm.judge_seed)
    calls = pairwise.ordered_calls(pairs, rm.pair_orders, group=group.group, seed=rm.judge_seed)
    answers = await asyncio.gather(*(ask(GroupRequest(group.group, (members[a], members[b])), deadline_s)
                                     for a, b in calls))
    outcomes = [None if isinstance(answer, BaseException) else float(answer) for answer in answers]
    results = pairwise.pair_results(calls, outcomes)
    aggregate = pairwise.win_rate if rm.pair_aggregate == "win_rate" else pairwise.bradley_terry
    values = aggregate(n, results)
    flipped, both = pairwise.position_flips(calls, outcomes)
    cyclic, triples = pairwise.intransitive_triples(n, results) if plan == "all_pairs" else (0, 0)
    counts.add_all({"comparisons": len(calls), "comparisons_failed": outcomes.count(None),
                    "ties": pairwise.count_ties(outcomes), "flipped": flipped, "both_orders": both, "cyclic": cyclic,
                    "triples": triples})
    scores: list[float | AsyncRMError] = [0.0] * n
    texts = [""] * n
    for i, value in enumerate(values):
        compared = [pair for pair in results if i in pair]
        if value is None:
            failure = next((a for (x, y), a in zip(calls, answers) if i in (x, y) and isinstance(a, AsyncRMError)),
                           None)
            scores[order[i]] = _unscored(group, members[i].uid, compared, rm.pair_aggregate, failure)
        else:
            scores[order[i]] = value
            texts[order[i]] = f"{rm.pair_aggregate} {value:.3f} over {len(compared)} compared pair(s)"
    return GroupVerdict(tuple(scores), tuple(texts))


def _unscored(group: GroupRequest, uid: str, compared: list, aggregate: str, failure: AsyncRMError | None
              ) -> AsyncRMError:
    """Why a member got no reward: alone in its group, no pair of it answered in every order asked (its first
    error), or (``bradley_terry``) its part of the comparison graph is not the one scored."""
    if len(group.members) == 1:
        return RewardModelError(f"trajectory {uid}: the only response of its group to reach the pairwise judge, with "
                                "none to compare it with (its siblings failed or were withdrawn)")
    if not compared:
        err = RewardModelError(f"trajectory {uid}: none of its pairs in {group.uid} was answered in every order asked"
                               + (f"; the first error: {failure}" if failure is not None else ""))
        err.__cause__ = failure
        return err
    return RewardModelError(f"trajectory {uid}: with pair_aggregate={aggregate} its answered comparisons in "
                            f"{group.uid} do not join the largest connected part of the group (the graph fell "
                            "apart: too many comparisons failed). Fix: see the comparisons' errors, or use "
                            "pair_aggregate=win_rate")


def pair_metrics(step: dict[str, float], trajectories: int) -> dict[str, float | None]:
    """A step's pairwise metrics from its :data:`PAIR_COUNTS`: comparisons asked and per trajectory, the share of
    pairs asked in both orders whose answers disagree (``position_flip_rate``), the share of triples with a cycle
    (``intransitive_rate``, ``all_pairs``), ties."""
    return {"comparisons": step["comparisons"],
            "comparisons_per_trajectory": step["comparisons"] / trajectories if trajectories else None,
            "comparisons_failed": step["comparisons_failed"], "pairwise_ties": step["ties"],
            "position_flip_rate": step["flipped"] / step["both_orders"] if step["both_orders"] else None,
            "intransitive_rate": step["cyclic"] / step["triples"] if step["triples"] else None}
