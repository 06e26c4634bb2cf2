"""A pairwise judge's math: which pairs of a group to compare and in which order, how a reply reads, and how the
answers become one reward per response. Pure functions over member indices ``0..n-1`` (the members in a stable
order, e.g. sorted by id): no model, no I/O.

An ordered call ``(a, b)`` shows response ``a`` first (``{{ response_a }}``) and ``b`` second. Its outcome is a number
in [0, 1] from the first position's point of view: 1 when the first wins, 0.5 for a tie, 0 when the second wins
(:func:`winner_outcome`); the logits readout gives P(first wins) = p(A) / (p(A) + p(B)). A failed call's outcome is
None.

Formulas (``r_ij``: P(i beats j) for a compared pair, from :func:`pair_results`; ``C_i``: the responses i was compared
with)::

    pair value     r_ij = mean over the orders asked of that order's mean outcome, seen from i
                          (outcome o of call (i, j) counts o, of call (j, i) counts 1 - o);  r_ji = 1 - r_ij
    win_rate       s_i = (1 / |C_i|) * sum_{j in C_i} r_ij                     (None when C_i is empty)
    bradley_terry  maximise  sum_{compared {i, j}} (r_ij + a) log(p_i / (p_i + p_j)) + (r_ji + a) log(p_j / (p_i + p_j))
                   over p > 0: a = ``prior`` virtual wins each way per compared pair (default 0.5) keeps every p finite;
                   MM (Hunter 2004): p_i <- sum_{j in C_i} (r_ij + a) / sum_{j in C_i} (1 + 2a) / (p_i + p_j);
                   t_i = log p_i;  s_i = (t_i - min t) / (max t - min t), 0.5 each when max t - min t <= 1e-9,
                   rounded to 9 decimals (the MM stops at 1e-12 per sweep: equal strengths read equal);
                   scored: the largest connected part of the comparison graph; None elsewhere (all None when two
                   parts tie for largest or the largest has one member)
    flip rate      over pairs asked in both orders with an answer in each: the share where
                   sign(f - 1/2) != sign(1 - g - 1/2), f and g the mean outcomes of (lo, hi) and (hi, lo)
                   (a win against a tie disagrees; for logits, P(win) on different sides of 0.5)
    intransitive   over triples whose three pairs were compared: the share with a cycle, r_ab > 1/2, r_bc > 1/2 and
                   r_ca > 1/2 in one of the two directions (a tie, r = 1/2, breaks every cycle)

Under ``both`` orders a judge that always prefers the first position answers 1 and 0 for each pair, so every
``r_ij`` is 0.5: it gains nothing."""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PLANS", "ORDERS", "REPLY_FORM", "default_plan", "plan_pairs", "calls_per_group", "ordered_calls",
           "winner_schema", "parse_winner", "last_json_object", "winner_outcome", "pair_results",
           "win_rate", "largest_component", "log_strengths", "bradley_terry", "position_flips", "position_flip_rate",
           "intransitive_triples", "intransitive_rate", "count_ties"]

PLANS = ("all_pairs", "circular", "random_k")
ORDERS = ("both", "one")
#: Up to this many responses the default plan compares every pair; above, each with its next.
ALL_PAIRS_UP_TO = 8
#: What a re-ask tells a pairwise judge its reply must look like.
REPLY_FORM = 'reply with only a JSON object: {"winner": "A"}, {"winner": "B"} or {"winner": "tie"}'
_WINNERS = {"a": "A", "b": "B", "tie": "tie"}
_OUTCOMES = {"A": 1.0, "B": 0.0, "tie": 0.5}
_FLAT = 1e-9  # log-strength spread below which a group is scored 0.5 each
_DECIMALS = 9  # of a Bradley-Terry score: far above the MM's stopping change, far below any real difference
_MM_TOL = 1e-12
_MM_SWEEPS = 100_000

Pair = tuple[int, int]


def _rng(*parts: object) -> random.Random:
    """A generator seeded by SHA-256 of ``parts`` (not Python's salted ``hash``): the same draws in every process."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


# ----------------------------------------------------------------------------------------------- plans and orders


def default_plan(n: int) -> str:
    """``all_pairs`` up to ``ALL_PAIRS_UP_TO`` (8) responses, ``circular`` above."""
    return "all_pairs" if n <= ALL_PAIRS_UP_TO else "circular"


def plan_pairs(n: int, plan: str, *, k: int | None = None, group: str, seed: int) -> list[Pair]:
    """The unordered pairs ``(a, b)``, ``a < b``, sorted, that ``plan`` compares in a group of ``n``.

    ``all_pairs``: every pair, n(n-1)/2. ``circular``: each response with the next, i and (i+1) mod n: n pairs for
    n > 2, 1 for n = 2. ``random_k``: each response against ``k`` others: the members in an order shuffled by ``seed``
    and ``group`` (SHA-256, the same in every process and run), each joined to the next k//2 in that circle, and for
    odd k to the one opposite; ceil(n k / 2) pairs, every response in k of them (one in k + 1 when n and k are both
    odd), none twice; all pairs when k >= n - 1. A group of one has no pair."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: a group has at least one response; pass its size")
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r} is not a pair plan; use one of {', '.join(PLANS)}")
    if plan != "random_k" and k is not None:
        raise ValueError(f"k={k!r}: only random_k compares each response with k others; drop k for {plan}")
    if plan == "random_k" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k={k!r}: random_k compares each response with k others; set k to an integer >= 1")
    if plan == "circular" and n > 2:
        return sorted((min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n))
    if plan == "all_pairs" or n <= 2 or (plan == "random_k" and k >= n - 1):
        return [(a, b) for a in range(n) for b in range(a + 1, n)]
    assert k is not None  # random_k, 1 <= k <= n - 2
    order = list(range(n))
    _rng("pairs", seed, group).shuffle(order)
    joined = [(order[i], order[(i + d) % n]) for d in range(1, k // 2 + 1) for i in range(n)]
    if k % 2:  # n even: a perfect matching across the circle; n odd: (n + 1) / 2 pairs, one member in two of them
        joined += [(order[i], order[(i + (n + 1) // 2) % n]) for i in range((n + 1) // 2)]
    pairs = sorted((min(a, b), max(a, b)) for a, b in joined)
    assert len(set(pairs)) == len(pairs) == math.ceil(n * k / 2), (n, k, pairs)
    return pairs


def calls_per_group(n: int, plan: str, orders: str, *, k: int | None = None) -> int:
    """Judge calls for a group of ``n``: the pairs of ``plan`` (n(n-1)/2; n, or 1 for n = 2; ceil(n k / 2), or
    n(n-1)/2 when k >= n - 1), times 2 for ``both`` orders."""
    if orders not in ORDERS:
        raise ValueError(f"orders={orders!r} is not a pair order; use one of {', '.join(ORDERS)}")
    return len(plan_pairs(n, plan, k=k, group="", seed=0)) * (2 if orders == "both" else 1)


def ordered_calls(pairs: Sequence[Pair], orders: str, *, group: str, seed: int) -> list[Pair]:
    """The judge calls ``(first, second)`` for ``pairs``: ``both``, each pair as ``(a, b)`` then ``(b, a)``; ``one``,
    each pair once in the order a coin seeded by ``seed``, ``group`` and the pair alone picks (the same every run,
    whatever the other pairs)."""
    if orders not in ORDERS:
        raise ValueError(f"orders={orders!r} is not a pair order; use one of {', '.join(ORDERS)}")
    calls: list[Pair] = []
    for a, b in pairs:
        if a == b:
            raise ValueError(f"pair {(a, b)!r} compares a response with itself; pass pairs of two members")
        if orders == "both":
            calls += [(a, b), (b, a)]
        else:
            lo, hi = min(a, b), max(a, b)
            calls.append((lo, hi) if _rng("orders", seed, group, lo, hi).random() < 0.5 else (hi, lo))
    return calls


# ------------------------------------------------------------------------------------------------ reading a reply


def winner_schema() -> dict[str, Any]:
    """The JSON schema of a reply (structured output): an object with exactly the key ``winner``, one of ``"A"``,
    ``"B"``, ``"tie"``."""
    return {"type": "object", "properties": {"winner": {"type": "string", "enum": ["A", "B", "tie"]}},
            "required": ["winner"], "additionalProperties": False}


def parse_winner(text: str) -> str:
    """``"A"``, ``"B"`` or ``"tie"``: the ``winner`` of the last JSON object in ``text`` (words and code fences around
    it allowed; the value's case and surrounding spaces ignored). ``ValueError`` with the reason, in a few words, when
    there is no JSON object, its keys are not exactly ``winner``, or the value is not one of the three."""
    pairs = last_json_object(text)
    keys = [key for key, _ in pairs]
    if keys != ["winner"]:
        raise ValueError("its JSON object gives the winner twice" if keys.count("winner") > 1 else
                         f"its JSON object's keys are {keys}, not exactly ['winner']")
    value = pairs[0][1]
    winner = _WINNERS.get(value.strip().casefold()) if isinstance(value, str) else None
    if winner is None:
        raise ValueError(f"the winner {value!r} is not one of 'A', 'B', 'tie'")
    return winner


def last_json_object(text: str) -> list[tuple[Any, Any]]:
    """The key-value pairs of the last complete top-level JSON object in ``text`` (pairs, so a repeated key shows):
    a judge's reply read as a group or pairwise judge reads it. ``ValueError`` with the reason when there is none (an
    object nested too deep to parse counts as one that does not parse)."""
    decoder = json.JSONDecoder(object_pairs_hook=lambda pairs: pairs)
    found, start, last_error = None, text.find("{"), None
    while start >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError) as err:
            last_error, start = err, text.find("{", start + 1)
            continue
        found, start = value, text.find("{", end)
    if found is None:
        raise ValueError("there is no JSON object in it" if last_error is None else
                         f"its JSON object does not parse ({getattr(last_error, 'msg', 'nested too deep')})")
    return found


def winner_outcome(winner: str) -> float:
    """A call's outcome from the first position's view: ``A`` (first) 1.0, ``tie`` 0.5, ``B`` (second) 0.0."""
    if winner not in _OUTCOMES:
        raise ValueError(f"winner={winner!r} is not one of 'A', 'B', 'tie'; read it with parse_winner")
    return _OUTCOMES[winner]


# --------------------------------------------------------------------------------------------------- combining


def _check_calls(calls: Sequence[Pair], outcomes: Sequence[float | None]) -> None:
    if len(calls) != len(outcomes):
        raise ValueError(f"{len(calls)} calls but {len(outcomes)} outcomes; pass one outcome (or None) per call")
    for call, outcome in zip(calls, outcomes, strict=True):
        if call[0] == call[1] or min(call) < 0:
            raise ValueError(f"call {call!r} is not two different members' indices")
        if outcome is not None and not (math.isfinite(outcome) and 0.0 <= outcome <= 1.0):
            raise ValueError(f"call {call!r}'s outcome {outcome!r} is not in [0, 1]; pass P(first wins), or None "
                             "for a failed call")


def _order_means(calls: Sequence[Pair], outcomes: Sequence[float | None]) -> dict[Pair, list[float | None]]:
    """Per unordered pair ``(lo, hi)``: ``[mean outcome of (lo, hi), mean outcome of (hi, lo)]``, each seen from
    ``lo`` (so the second is 1 - the outcome), None for an order with no answer."""
    _check_calls(calls, outcomes)
    sums: dict[Pair, list[list[float]]] = {}
    for (a, b), outcome in zip(calls, outcomes, strict=True):
        if outcome is not None:
            seen = sums.setdefault((min(a, b), max(a, b)), [[], []])
            seen[0 if a < b else 1].append(outcome if a < b else 1.0 - outcome)
    return {pair: [sum(o) / len(o) if o else None for o in seen] for pair, seen in sums.items()}


def pair_results(calls: Sequence[Pair], outcomes: Sequence[float | None]) -> dict[Pair, float]:
    """Per unordered pair ``(lo, hi)`` answered in every order asked of it: P(``lo`` wins), the mean over those
    orders of each order's mean outcome seen from ``lo``. Failed calls (None) are left out; a pair with an order
    asked and not answered is absent (read from one order, a judge's position preference would count)."""
    asked: dict[Pair, set[int]] = {}
    for a, b in calls:
        asked.setdefault((min(a, b), max(a, b)), set()).add(0 if a < b else 1)
    results = {}
    for pair, means in _order_means(calls, outcomes).items():
        answered = [v for k in asked[pair] if (v := means[k]) is not None]
        if len(answered) == len(asked[pair]):
            results[pair] = sum(answered) / len(answered)
    return results


def _check_scores(n: int, pair_scores: Mapping[Pair, float]) -> None:
    for (a, b), value in pair_scores.items():
        if not 0 <= a < b < n:
            raise ValueError(f"pair {(a, b)!r} is not (lo, hi) with 0 <= lo < hi < n={n}; use pair_results' keys")
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"pair {(a, b)!r}'s value {value!r} is not P(lo wins) in [0, 1]")


def win_rate(n: int, pair_scores: Mapping[Pair, float]) -> list[float | None]:
    """Each response's mean of P(it wins) over the pairs it was compared in (a pair counts once, both orders
    averaged); None for a response with no compared pair."""
    _check_scores(n, pair_scores)
    wins, counts = [0.0] * n, [0] * n
    for (a, b), value in pair_scores.items():
        wins[a] += value
        wins[b] += 1.0 - value
        counts[a] += 1
        counts[b] += 1
    return [w / c if c else None for w, c in zip(wins, counts, strict=True)]


def largest_component(n: int, pairs: Sequence[Pair]) -> list[int]:
    """The members of the largest connected part of the graph whose edges are ``pairs``, sorted; empty when two
    parts tie for largest or the largest is a lone response (no pair)."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs:
        parent[root(a)] = root(b)
    parts: dict[int, list[int]] = {}
    for i in range(n):
        parts.setdefault(root(i), []).append(i)
    sizes = sorted((len(p) for p in parts.values()), reverse=True)
    if not sizes or sizes[0] < 2 or (len(sizes) > 1 and sizes[1] == sizes[0]):
        return []
    return max(parts.values(), key=len)


def log_strengths(n: int, pair_scores: Mapping[Pair, float], prior: float = 0.5) -> list[float | None]:
    """The Bradley-Terry log-strengths ``t_i`` (module docstring: ``prior`` virtual wins each way per compared pair)
    of the members of :func:`largest_component`, centred on their mean; None for every other member."""
    _check_scores(n, pair_scores)
    if not (math.isfinite(prior) and prior > 0):
        raise ValueError(f"prior={prior!r}: Bradley-Terry needs a prior > 0 to keep the strengths finite "
                         "(e.g. 0.5 virtual wins each way per pair)")
    members = largest_component(n, list(pair_scores))
    if not members:
        return [None] * n
    inside = set(members)
    wins = dict.fromkeys(members, 0.0)
    rivals: dict[int, list[int]] = {i: [] for i in members}
    for (a, b), value in pair_scores.items():
        if a in inside:
            wins[a] += value + prior
            wins[b] += 1.0 - value + prior
            rivals[a].append(b)
            rivals[b].append(a)
    games = 1.0 + 2.0 * prior
    strength = dict.fromkeys(members, 1.0)
    for _ in range(_MM_SWEEPS):  # Gauss-Seidel MM sweeps: each update raises the likelihood
        change = 0.0
        for i in members:
            new = wins[i] / sum(games / (strength[i] + strength[j]) for j in rivals[i])
            change = max(change, abs(math.log(new / strength[i])))
            strength[i] = new
        centre = math.exp(sum(math.log(strength[i]) for i in members) / len(members))
        for i in members:
            strength[i] /= centre
        if change < _MM_TOL:
            break
    else:
        raise RuntimeError(f"Bradley-Terry's MM did not converge in {_MM_SWEEPS} sweeps (pairs: {dict(pair_scores)})")
    return [math.log(strength[i]) if i in inside else None for i in range(n)]


def bradley_terry(n: int, pair_scores: Mapping[Pair, float], prior: float = 0.5) -> list[float | None]:
    """Each member's Bradley-Terry log-strength min-max scaled to [0, 1] within the scored part (0.5 each when they
    are all equal) and rounded to 9 decimals, so strengths equal in exact arithmetic (a complete round robin's
    members with equal wins) are not ordered by rounding noise; None outside :func:`largest_component` (module
    docstring)."""
    logs = log_strengths(n, pair_scores, prior)
    known = [t for t in logs if t is not None]
    if not known:
        return logs
    low, spread = min(known), max(known) - min(known)
    return [None if t is None else (0.5 if spread <= _FLAT else round((t - low) / spread, _DECIMALS)) for t in logs]


# ----------------------------------------------------------------------------------------------------- metrics


def _side(value: float) -> int:
    return (value > 0.5) - (value < 0.5)


def position_flips(calls: Sequence[Pair], outcomes: Sequence[float | None]) -> tuple[int, int]:
    """``(flipped, asked)``: of the pairs answered in both orders (``asked``), those whose two orders disagree once
    seen from the same member (a win against a tie disagrees; for P(win), different sides of 0.5)."""
    both = [means for means in _order_means(calls, outcomes).values() if None not in means]
    return sum(_side(f) != _side(g) for f, g in both), len(both)


def position_flip_rate(calls: Sequence[Pair], outcomes: Sequence[float | None]) -> float | None:
    """:func:`position_flips`' share; None when no pair was answered in both orders."""
    flipped, asked = position_flips(calls, outcomes)
    return flipped / asked if asked else None


def intransitive_triples(n: int, pair_scores: Mapping[Pair, float]) -> tuple[int, int]:
    """``(cyclic, triples)``: of the triples whose three pairs were compared (every triple under ``all_pairs``), those
    where a beats b beats c beats a (P > 0.5 each; a tie breaks the cycle)."""
    _check_scores(n, pair_scores)
    cyclic = triples = 0
    for a in range(n):
        for b in range(a + 1, n):
            for c in range(b + 1, n):
                if (a, b) in pair_scores and (b, c) in pair_scores and (a, c) in pair_scores:
                    triples += 1
                    sides = (_side(pair_scores[a, b]), _side(pair_scores[b, c]), _side(1.0 - pair_scores[a, c]))
                    cyclic += sides in ((1, 1, 1), (-1, -1, -1))
    return cyclic, triples


def intransitive_rate(n: int, pair_scores: Mapping[Pair, float]) -> float | None:
    """:func:`intransitive_triples`' share; None when no triple has its three pairs compared."""
    cyclic, triples = intransitive_triples(n, pair_scores)
    return cyclic / triples if triples else None


def count_ties(outcomes: Sequence[float | None]) -> int:
    """Answered calls whose outcome is a tie (exactly 0.5)."""
    return sum(o == 0.5 for o in outcomes if o is not None)
