"""Shared prompts computed once: the common prefix of sibling RM inputs runs once per packed forward.

GRPO samples ``n`` responses per prompt; after (re-)templating, the siblings' RM inputs (same
:attr:`~verl_async_rm.rm.RMRequest.group`) share a long prefix. It is found as the longest common prefix of their
token ids (:func:`common_prefix`), so template quirks cannot break it, and capped one token short of the shortest
sibling so every row keeps a token of its own to read its score at.

In a packed forward (:func:`shared_layout`) each such prefix is one segment with positions ``0..P-1``, followed by
each sibling's own tokens as a segment with positions ``P..``; a row without siblings is one whole segment. The
attention of a sibling's segment reads ``[its prefix's keys/values ; its own]``: the variable-length attention
function gathers them with one ``index_select`` per layer (``rm_key_index``) and runs with separate query and key
boundaries, causal from the bottom right (query ``i`` of a segment with ``Lq`` queries and ``Lk`` keys sees keys
``0..i + Lk - Lq``), which is exactly what the sibling's tokens see in its full sequence. Scores equal the unshared
path's up to summation order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

__all__ = ["MIN_SHARED_PREFIX", "common_prefix", "plan_shared_micro_batches", "SharedLayout", "shared_layout"]

#: Siblings share a prefix only when it is at least this long (shorter ones save less than the gather costs).
MIN_SHARED_PREFIX = 16


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of ``rows``, at most one less than the shortest row."""
    shortest = min(len(r) for r in rows)
    first = rows[0]
    n = 0
    while n < shortest - 1 and all(r[n] == first[n] for r in rows[1:]):
        n += 1
    return n


def _sibling_sets(groups: Sequence[Hashable | None]) -> list[list[int]]:
    """Indices by group, in first-seen order; a row without a group is a set of its own."""
    sets: dict[Any, list[int]] = {}
    out: list[list[int]] = []
    for i, group in enumerate(groups):
        if group is None:
            out.append([i])
        elif group in sets:
            sets[group].append(i)
        else:
            sets[group] = [i]
            out.append(sets[group])
    return out


def plan_shared_micro_batches(
    inputs: Sequence[Sequence[int]], groups: Sequence[Hashable | None], max_tokens: int,
    min_prefix: int = MIN_SHARED_PREFIX,
) -> list[list[int]]:
    """Micro-batches (index lists) for packed forwards that keep siblings together, within ``max_tokens`` of
    computed tokens (a shared prefix counted once).

    Siblings with a common prefix of at least ``min_prefix`` tokens form a unit (split into several when prefix plus
    their own tokens exceed the budget); every other input is a unit alone. Units are placed first-fit decreasing by
    cost. Every index appears in exactly one micro-batch.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens!r}: must be positive")
    units: list[tuple[int, list[int]]] = []  # (cost, indices)
    for rows in _sibling_sets(groups):
        prefix = common_prefix([inputs[i] for i in rows]) if len(rows) > 1 else 0
        if prefix < min_prefix:
            units.extend((max(len(inputs[i]), 1), [i]) for i in rows)
            continue
        chunk: list[int] = []
        cost = prefix
        for i in sorted(rows, key=lambda i: len(inputs[i]), reverse=True):
            own = len(inputs[i]) - prefix
            if chunk and cost + own > max_tokens:
                units.append((cost if len(chunk) > 1 else len(inputs[chunk[0]]), chunk))
                chunk, cost = [], prefix
            chunk.append(i)
            cost += own
        units.append((cost if len(chunk) > 1 else len(inputs[chunk[0]]), chunk))
    units.sort(key=lambda unit: unit[0], reverse=True)
    batches: list[list[int]] = []
    room: list[int] = []
    for cost, rows in units:
        slot = next((b for b, left in enumerate(room) if cost <= left), None)
        if slot is None:
            batches.append(list(rows))
            room.append(max_tokens - cost)
        else:
            batches[slot].extend(rows)
            room[slot] -= cost
    return batches


@dataclass
class SharedLayout:
    """A packed forward with shared prefixes, on the device.

    Attributes:
        input_ids, position_ids: ``(1, T)`` query tokens (each prefix once, then the rows' own tokens).
        cu_q, cu_k: ``(S + 1,)`` int32 boundaries of the ``S`` segments' queries and of their gathered keys.
        key_index: ``(sum of key lengths,)`` int64: for each segment, its prefix's token positions (if any) then its own.
        max_q, max_k: the longest segment's queries and keys.
        last: ``(N,)`` int64 index of every row's last token, in the order of the rows given.
        computed: query tokens (``T``); saved: tokens a plain packed forward would have computed on top.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    key_index: torch.Tensor
    max_q: int
    max_k: int
    last: torch.Tensor
    computed: int
    saved: int

    def attention_kwargs(self) -> dict[str, Any]:
        """What HF passes down to every attention call."""
        return {
            "cu_seq_lens_q": self.cu_q,
            "cu_seq_lens_k": self.cu_k,
            "max_length_q": self.max_q,
            "max_length_k": self.max_k,
            "rm_key_index": self.key_index,
        }


def shared_layout(
    batch: Sequence[Sequence[int]], groups: Sequence[Hashable | None], device: torch.device,
    min_prefix: int = MIN_SHARED_PREFIX,
) -> SharedLayout:
    """The :class:`SharedLayout` of ``batch``: siblings whose common prefix is at least ``min_prefix`` share it."""
    ids: list[int] = []
    positions: list[int] = []
    keys: list[int] = []
    cu_q, cu_k = [0], [0]
    last = [0] * len(batch)

    def segment(tokens: Sequence[int], start_position: int, prefix: tuple[int, int] | None) -> int:
        begin = len(ids)
        ids.extend(tokens)
        positions.extend(range(start_position, start_position + len(tokens)))
        if prefix is not None:
            keys.extend(range(*prefix))
        keys.extend(range(begin, len(ids)))
        cu_q.append(len(ids))
        cu_k.append(len(keys))
        return begin

    for rows in _sibling_sets(groups):
        prefix = common_prefix([batch[i] for i in rows]) if len(rows) > 1 else 0
        if prefix < min_prefix:
            for i in rows:
                segment(batch[i], 0, None)
                last[i] = len(ids) - 1
            continue
        begin = segment(batch[rows[0]][:prefix], 0, None)
        for i in rows:
            segment(batch[i][prefix:], prefix, (begin, begin + prefix))
            last[i] = len(ids) - 1
    q_lengths = [b - a for a, b in pairwise(cu_q)]
    k_lengths = [b - a for a, b in pairwise(cu_k)]
    non_blocking = device.type == "cuda"

    def put(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=non_blocking)

    return SharedLayout(
        input_ids=put(ids, torch.long)[None],
        position_ids=put(positions, torch.long)[None],
        cu_q=put(cu_q, torch.int32),
        cu_k=put(cu_k, torch.int32),
        key_index=put(keys, torch.long),
        max_q=max(q_lengths),
        max_k=max(k_lengths),
        last=put(last, torch.long),
        computed=len(ids),
        saved=sum(len(r) for r in batch) - len(ids),
    )
