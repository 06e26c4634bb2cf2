"""A pairwise judge's math (``verl_async_rm.scoring.pairwise``): the pair plans and orders, how a reply reads, how the
answers of both orders combine, win_rate and bradley_terry against groups computed by hand, and the metrics on crafted
answers."""

from __future__ import annotations

import math

import pytest

from verl_async_rm.scoring.pairwise import (bradley_terry, calls_per_group, count_ties, default_plan,
                                            intransitive_rate, intransitive_triples, largest_component,
                                            log_strengths, ordered_calls, pair_results, parse_winner,
                                            plan_pairs, position_flip_rate, position_flips, win_rate, winner_outcome,
                                            winner_schema)

pytestmark = pytest.mark.unit


def answers(replies: dict[tuple[int, int], str]) -> tuple[list[tuple[int, int]], list[float]]:
    """Calls and their outcomes from ``{(first, second): "A" | "B" | "tie"}``."""
    return list(replies), [winner_outcome(w) for w in replies.values()]


# -------------------------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize("n", range(1, 11))
def test_all_pairs_and_circular_have_their_counts(n):
    pairs = plan_pairs(n, "all_pairs", group="g", seed=0)
    assert len(pairs) == n * (n - 1) // 2 and pairs == sorted(set(pairs))
    assert all(a < b for a, b in pairs)
    ring = plan_pairs(n, "circular", group="g", seed=0)
    assert len(ring) == {1: 0, 2: 1}.get(n, n) and len(set(ring)) == len(ring)
    assert all(sum(i in pair for pair in ring) == min(2, n - 1) for i in range(n))


@pytest.mark.parametrize("n", range(2, 12))
def test_random_k_compares_every_response_at_least_k_times_and_no_pair_twice(n):
    for k in range(1, n + 2):
        pairs = plan_pairs(n, "random_k", k=k, group=f"uid-{n}", seed=3)
        assert len(set(pairs)) == len(pairs) and all(0 <= a < b < n for a, b in pairs)
        kept = min(k, n - 1)
        assert len(pairs) == (n * (n - 1) // 2 if k >= n - 1 else math.ceil(n * k / 2))
        degrees = [sum(i in pair for pair in pairs) for i in range(n)]
        assert min(degrees) >= kept and sum(d > kept for d in degrees) <= 1


def test_random_k_is_the_same_every_run_and_differs_by_group_and_seed():
    pairs = plan_pairs(6, "random_k", k=2, group="uid-7", seed=0)
    # pinned: SHA-256 of (seed, group), not Python's salted hash, so every process and run draws these
    assert pairs == [(0, 1), (0, 3), (1, 2), (2, 4), (3, 5), (4, 5)]
    assert plan_pairs(6, "random_k", k=2, group="uid-7", seed=0) == pairs
    assert plan_pairs(6, "random_k", k=2, group="uid-8", seed=0) != pairs
    assert plan_pairs(6, "random_k", k=2, group="uid-7", seed=1) != pairs


def test_the_default_plan_and_the_calls_per_group():
    assert [default_plan(n) for n in (2, 8, 9, 16)] == ["all_pairs", "all_pairs", "circular", "circular"]
    assert calls_per_group(8, "all_pairs", "both") == 56 and calls_per_group(8, "all_pairs", "one") == 28
    assert calls_per_group(16, "circular", "both") == 32 and calls_per_group(2, "circular", "one") == 1
    assert calls_per_group(7, "random_k", "one", k=3) == 11 and calls_per_group(4, "random_k", "both", k=5) == 12
    for n in (2, 5, 9):
        for plan, k in (("all_pairs", None), ("circular", None), ("random_k", 2)):
            pairs = plan_pairs(n, plan, k=k, group="g", seed=0)
            assert calls_per_group(n, plan, "both", k=k) == 2 * calls_per_group(n, plan, "one", k=k) == 2 * len(pairs)


@pytest.mark.parametrize(("call", "words"), [
    (lambda: plan_pairs(0, "all_pairs", group="g", seed=0), "at least one response"),
    (lambda: plan_pairs(4, "round_robin", group="g", seed=0), "use one of all_pairs, circular, random_k"),
    (lambda: plan_pairs(4, "circular", k=2, group="g", seed=0), "drop k"),
    (lambda: plan_pairs(4, "random_k", group="g", seed=0), "set k to an integer >= 1"),
    (lambda: plan_pairs(4, "random_k", k=0, group="g", seed=0), "set k to an integer >= 1"),
    (lambda: ordered_calls([(0, 1)], "twice", group="g", seed=0), "use one of both, one"),
    (lambda: ordered_calls([(1, 1)], "both", group="g", seed=0), "with itself"),
])
def test_bad_plans_and_orders_say_how_to_fix_them(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# ------------------------------------------------------------------------------------------------------- orders


def test_both_orders_ask_each_pair_each_way():
    pairs = plan_pairs(4, "all_pairs", group="g", seed=0)
    calls = ordered_calls(pairs, "both", group="g", seed=0)
    assert len(calls) == 2 * len(pairs) and calls[:2] == [(0, 1), (1, 0)]
    assert sorted(calls) == sorted([*pairs, *((b, a) for a, b in pairs)])


def test_one_order_asks_each_pair_once_in_a_stable_order():
    pairs = plan_pairs(8, "all_pairs", group="g", seed=0)
    calls = ordered_calls(pairs, "one", group="uid-7", seed=0)
    assert sorted((min(c), max(c)) for c in calls) == pairs
    assert ordered_calls(pairs, "one", group="uid-7", seed=0) == calls
    assert sorted(ordered_calls(pairs[::-1], "one", group="uid-7", seed=0)) == sorted(calls)  # per pair, not per list
    assert any(a > b for a, b in calls) and any(a < b for a, b in calls)
    assert ordered_calls(pairs, "one", group="uid-8", seed=0) != calls


# --------------------------------------------------------------------------------------------- reading a reply


@pytest.mark.parametrize(("text", "winner"), [
    ('{"winner": "A"}', "A"),
    ('{"winner": "b"}', "B"),
    ('{"winner": " Tie "}', "tie"),
    ('Response A is shorter but B is right.\n{"winner": "B"}', "B"),
    ('```json\n{"winner": "tie"}\n```', "tie"),
    ('At first {"winner": "A"}, but on reflection {"winner": "B"}', "B"),
])
def test_a_reply_reads_as_its_last_json_objects_winner(text, winner):
    assert parse_winner(text) == winner


@pytest.mark.parametrize(("text", "reason"), [
    ("Response A is better.", "there is no JSON object in it"),
    ('{"winner": "A"', "its JSON object does not parse"),
    ('{"best": "A"}', r"keys are \['best'\], not exactly \['winner'\]"),
    ('{"winner": "A", "why": "shorter"}', r"keys are \['winner', 'why'\]"),
    ('{"winner": "A"} and {"score": 3}', r"keys are \['score'\]"),
    ('{"winner": "A", "winner": "B"}', "gives the winner twice"),
    ('{"winner": "C"}', "'C' is not one of 'A', 'B', 'tie'"),
    ('{"winner": 1}', "1 is not one of"),
    ('{"winner": null}', "None is not one of"),
])
def test_a_reply_that_does_not_read_says_why(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_winner(text)


def test_the_schema_allows_exactly_a_winner_of_three():
    schema = winner_schema()
    assert schema["required"] == ["winner"] and schema["additionalProperties"] is False
    assert list(schema["properties"]) == ["winner"] and schema["properties"]["winner"]["enum"] == ["A", "B", "tie"]


def test_outcomes_from_a_winner():
    assert [winner_outcome(w) for w in ("A", "tie", "B")] == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="read it with parse_winner"):
        winner_outcome("a")


# ------------------------------------------------------------------------------------------------------ combining


def test_both_orders_are_averaged_so_a_first_position_judge_gains_nothing():
    calls = ordered_calls(plan_pairs(5, "all_pairs", group="g", seed=0), "both", group="g", seed=0)
    always_a = [winner_outcome("A")] * len(calls)
    scores = pair_results(calls, always_a)
    assert len(scores) == 10 and set(scores.values()) == {0.5}
    assert win_rate(5, scores) == [0.5] * 5 and bradley_terry(5, scores) == [0.5] * 5
    assert position_flips(calls, always_a) == (10, 10)


def test_pair_results_see_each_pair_from_its_lower_index():
    calls, outcomes = answers({(0, 1): "A", (1, 0): "B", (0, 2): "A", (2, 0): "A", (1, 2): "B", (2, 1): "A"})
    assert pair_results(calls, outcomes) == {(0, 1): 1.0, (0, 2): 0.5, (1, 2): 0.0}
    # logits: 0.8 for 0 first, 0.4 for 1 first (0.6 for 0): the mean of the two orders
    assert pair_results([(0, 1), (1, 0)], [0.8, 0.4]) == {(0, 1): pytest.approx(0.7)}
    # each order's mean first, then the orders': a repeated order does not outweigh the other
    assert pair_results([(0, 1), (0, 1), (1, 0)], [1.0, 0.0, 0.0]) == {(0, 1): 0.75}


def test_a_pair_counts_only_when_every_order_asked_of_it_was_answered():
    calls = [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2)]
    assert pair_results(calls, [None, 0.0, None, None, 1.0]) == {(1, 2): 1.0}  # (1, 2) was asked in one order only
    # a judge that always prefers the first position, one order failed: the pair is not read from the other
    assert pair_results([(0, 1), (1, 0)], [1.0, None]) == {}
    assert win_rate(2, pair_results([(0, 1), (1, 0)], [1.0, None])) == [None, None]
    # a repeated order with one answer still counts that order
    assert pair_results([(0, 1), (0, 1), (1, 0)], [1.0, None, 1.0]) == {(0, 1): 0.5}
    with pytest.raises(ValueError, match="one outcome"):
        pair_results(calls, [1.0])
    with pytest.raises(ValueError, match=r"not in \[0, 1\]"):
        pair_results([(0, 1)], [1.5])
    with pytest.raises(ValueError, match="two different members"):
        pair_results([(2, 2)], [1.0])


# ----------------------------------------------------------------------------------------------------- win_rate

#: 0 beats 1; 0 and 2 tie (each order won by the first); 2 beats 1.
TRIANGLE = {(0, 1): 1.0, (0, 2): 0.5, (1, 2): 0.0}


def test_win_rate_by_hand():
    # 0: (1 + 0.5) / 2; 1: (0 + 0) / 2; 2: (0.5 + 1) / 2
    assert win_rate(3, TRIANGLE) == [0.75, 0.0, 0.75]
    # logits: P(0 beats 1) = 0.7, P(1 beats 2) = 0.6 -> 0: 0.7; 1: (0.3 + 0.6) / 2; 2: 0.4
    assert win_rate(3, {(0, 1): 0.7, (1, 2): 0.6}) == pytest.approx([0.7, 0.45, 0.4])


def test_a_response_with_no_comparison_gets_no_win_rate():
    assert win_rate(4, TRIANGLE) == [0.75, 0.0, 0.75, None]
    assert win_rate(2, {}) == [None, None]
    with pytest.raises(ValueError, match="0 <= lo < hi < n=3"):
        win_rate(3, {(1, 0): 1.0})
    with pytest.raises(ValueError, match="P\\(lo wins\\)"):
        win_rate(3, {(0, 1): 2.0})


# ------------------------------------------------------------------------------------------------ bradley_terry


def test_bradley_terry_by_hand_on_a_symmetric_triangle():
    # wins with the prior a = 0.5: W0 = 1.5 + 1 = 2.5, W1 = 0.5 + 0.5 = 1, W2 = 1 + 1.5 = 2.5, 2 games a pair.
    # By symmetry p0 = p2 = x, p1 = 1; member 1: 1 = 2/(1 + x) + 2/(1 + x) -> x = 3 (member 0: 6/4 + 1 = 2.5).
    t = math.log(3)
    assert log_strengths(3, TRIANGLE) == pytest.approx([t / 3, -2 * t / 3, t / 3], abs=1e-9)
    assert bradley_terry(3, TRIANGLE) == [1.0, 0.0, 1.0]


def test_bradley_terry_on_a_tree_is_each_edges_odds():
    # on a tree every edge fits exactly: t_i - t_j = log((r_ij + a) / (r_ji + a))
    assert log_strengths(2, {(0, 1): 0.75}) == pytest.approx([math.log(5 / 3) / 2, -math.log(5 / 3) / 2])
    assert bradley_terry(2, {(0, 1): 0.75}) == [1.0, 0.0]
    assert bradley_terry(2, {(0, 1): 0.5}) == [0.5, 0.5]
    # path 0 - 1 - 2: t0 - t1 = log(1.5 / 0.5) = log 3, t1 - t2 = log(1.25 / 0.75) = log(5/3); t0 - t2 = log 5
    assert bradley_terry(3, {(0, 1): 1.0, (1, 2): 0.75}) == pytest.approx([1.0, math.log(5 / 3) / math.log(5), 0.0])
    # a prior of 0.1: t0 - t1 = log(1.1 / 0.1)
    logs = log_strengths(2, {(0, 1): 1.0}, prior=0.1)
    assert logs[0] - logs[1] == pytest.approx(math.log(11))


def test_bradley_terry_meets_its_likelihood_equations_on_a_full_group():
    # the log-likelihood is concave in t: its maximum is where, for every i,
    # sum_j (r_ij + a) = sum_j (1 + 2a) p_i / (p_i + p_j)
    scores = {(0, 1): 1.0, (0, 2): 0.75, (0, 3): 0.0, (1, 2): 0.25, (1, 3): 0.5, (2, 3): 1.0}
    a = 0.5
    p = [math.exp(t) for t in log_strengths(4, scores, prior=a)]
    for i in range(4):
        won = sum((v if i == lo else 1 - v) + a for (lo, hi), v in scores.items() if i in (lo, hi))
        expected = sum((1 + 2 * a) * p[i] / (p[i] + p[hi if i == lo else lo])
                       for (lo, hi) in scores if i in (lo, hi))
        assert won == pytest.approx(expected, abs=1e-9)


def test_a_cycle_and_a_flat_group_score_half_each():
    cycle = {(0, 1): 1.0, (1, 2): 1.0, (0, 2): 0.0}  # 0 beats 1 beats 2 beats 0
    assert bradley_terry(3, cycle) == [0.5] * 3 and win_rate(3, cycle) == [0.5] * 3


def test_bradley_terry_scores_only_the_largest_connected_part():
    split = {(0, 1): 1.0, (1, 2): 1.0, (3, 4): 1.0}
    assert largest_component(5, list(split)) == [0, 1, 2]
    assert bradley_terry(5, split) == pytest.approx([1.0, 0.5, 0.0, None, None])
    assert win_rate(5, split) == [1.0, 0.5, 0.0, 1.0, 0.0]  # win_rate needs no connection
    assert bradley_terry(4, TRIANGLE) == [1.0, 0.0, 1.0, None]  # a response with no comparison


def test_bradley_terry_scores_no_one_when_two_parts_tie_for_largest():
    halves = {(0, 1): 1.0, (2, 3): 0.0}
    assert largest_component(4, list(halves)) == [] and bradley_terry(4, halves) == [None] * 4
    assert bradley_terry(3, {}) == [None] * 3


def test_bradley_terry_needs_a_positive_prior():
    for prior in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="prior > 0"):
            bradley_terry(3, TRIANGLE, prior=prior)


# ------------------------------------------------------------------------------------------------------- metrics


def test_position_flips_on_crafted_answers():
    calls = [(0, 1), (1, 0),  # 0 wins both: agree
             (0, 2), (2, 0),  # the first wins both: flip
             (1, 2), (2, 1),  # a tie against 1 winning: flip
             (0, 3),  # one order only: not counted
             (1, 3), (3, 1)]  # one order failed: not counted
    outcomes = [1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0, None, 1.0]
    assert position_flips(calls, outcomes) == (2, 3) and position_flip_rate(calls, outcomes) == pytest.approx(2 / 3)
    # logits: from 0's view 0.7 and 0.6 agree; 0.7 and 0.4 are on both sides of 0.5
    assert position_flips([(0, 1), (1, 0)], [0.7, 0.4]) == (0, 1)
    assert position_flips([(0, 1), (1, 0)], [0.7, 0.6]) == (1, 1)
    assert position_flip_rate([(0, 1), (2, 0)], [1.0, 0.0]) is None


def test_intransitive_triples_on_crafted_groups():
    # 0 beats 1 beats 2 beats 0, and 3 loses to all: of 4 triples, {0, 1, 2} is a cycle
    group = {(0, 1): 1.0, (1, 2): 1.0, (0, 2): 0.0, (0, 3): 1.0, (1, 3): 1.0, (2, 3): 1.0}
    assert intransitive_triples(4, group) == (1, 4) and intransitive_rate(4, group) == 0.25
    reverse = {pair: 1.0 - value for pair, value in group.items()}  # the other direction: still a cycle
    assert intransitive_triples(4, reverse) == (1, 4)
    assert intransitive_triples(4, {**group, (0, 2): 0.5}) == (0, 4)  # a tie breaks it
    assert intransitive_triples(4, {k: v for k, v in group.items() if k != (0, 2)}) == (0, 2)  # a pair missing
    assert intransitive_rate(3, {(0, 1): 1.0, (1, 2): 1.0}) is None


def test_ties_are_counted_among_the_answered_calls():
    assert count_ties([0.5, 1.0, None, 0.5, 0.0]) == 2
