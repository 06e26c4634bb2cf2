"""Shared prompts computed once: the longest common prefix of siblings' RM inputs (one token short of the shortest)
runs once per packed forward; each sibling's attention reads its keys, then its own, causal from the bottom right."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_async_rm.scoring.inputs import first_fit
from verl_async_rm.scoring.packing import concat_ranges, flat_ids, to_device

__all__ = ["MIN_SHARED_PREFIX", "common_prefix", "plan_shared_micro_batches", "SharedLayout", "shared_layout"]

#: Siblings share a prefix only when it is at least this long (shorter ones save less than the gather costs).
MIN_SHARED_PREFIX = 16


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of ``rows``, at most one less than the shortest row (a binary search over
    the length with slice comparisons, done in C)."""
    first = rows[0]
    low, high = 0, min(len(r) for r in rows) - 1
    while low < high:
        mid = (low + high + 1) // 2
        head = first[:mid]
        if all(r[:mid] == head for r in rows[1:]):
            low = mid
        else:
            high = mid - 1
    return max(low, 0)


def _prefix_sets(rows: Sequence[Sequence[int]], groups: Sequence[Hashable | None], min_prefix: int
                 ) -> list[tuple[int, list[int]]]:
    """``(shared prefix, indices)`` in first-seen order: the siblings of a group whose common prefix is at least
    ``min_prefix`` together, every other row alone with a prefix of 0."""
    sets: dict[tuple[bool, Any], list[int]] = {}
    for i, group in enumerate(groups):  # a row without a group is a set of its own
        sets.setdefault((group is None, i if group is None else group), []).append(i)
    out: list[tuple[int, list[int]]] = []
    for members in sets.values():
        prefix = common_prefix([rows[i] for i in members]) if len(members) > 1 else 0
        out.extend([(prefix, members)] if prefix >= min_prefix else [(0, [i]) for i in members])
    return out


def plan_shared_micro_batches(inputs: Sequence[Sequence[int]], groups: Sequence[Hashable | None], max_tokens: int,
                              min_prefix: int = MIN_SHARED_PREFIX) -> list[list[int]]:
    """Micro-batches for packed forwards within ``max_tokens`` computed tokens (a shared prefix counted once): siblings
    with a common prefix of at least ``min_prefix`` tokens form a unit (split when over the budget), placed first-fit
    decreasing with every other input."""
    units: list[tuple[int, list[int]]] = []  # (cost, indices)
    for prefix, rows in _prefix_sets(inputs, groups, min_prefix):
        chunk: list[int] = []
        cost = prefix  # the prefix once, then each row's own tokens: a lone row costs its length
        for i in sorted(rows, key=lambda i: len(inputs[i]), reverse=True):
            own = len(inputs[i]) - prefix
            if chunk and cost + own > max_tokens:
                units.append((cost, chunk))
                chunk, cost = [], prefix
            chunk.append(i)
            cost += own
        units.append((max(cost, 1), chunk))  # an empty row still takes a place
    return first_fit(units, max_tokens)


@dataclass
class SharedLayout:
    """A packed forward with shared prefixes, on the device: ``(1, T)`` query tokens (each prefix once), the
    segments' query and gathered-key boundaries, each segment's key positions (its prefix's, then its own), each row's
    last token, and the tokens computed and saved."""

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
            "cu_seq_lens_q": self.cu_q, "cu_seq_lens_k": self.cu_k, "max_length_q": self.max_q,
            "max_length_k": self.max_k, "rm_key_index": self.key_index}


def shared_layout(batch: Sequence[Sequence[int]], groups: Sequence[Hashable | None], device: torch.device,
                  min_prefix: int = MIN_SHARED_PREFIX) -> SharedLayout:
    """The :class:`SharedLayout` of ``batch``: siblings whose common prefix is at least ``min_prefix`` share it."""
    tokens: list[Sequence[int]] = []  # each segment's query tokens
    position_start: list[int] = []  # each segment's first position
    prefix_of: list[int] = []  # the segment holding each segment's shared prefix, -1 for none
    last_segment = [0] * len(batch)  # the segment ending each row

    for prefix, rows in _prefix_sets(batch, groups, min_prefix):
        shared = -1
        if prefix:  # the siblings' prefix, once
            shared = len(tokens)
            tokens.append(batch[rows[0]][:prefix])
            position_start.append(0)
            prefix_of.append(-1)
        for i in rows:
            last_segment[i] = len(tokens)
            tokens.append(batch[i][prefix:] if prefix else batch[i])
            position_start.append(prefix)
            prefix_of.append(shared)
    q_len = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    q_end = np.cumsum(q_len)
    q_start = q_end - q_len
    total = int(q_end[-1])
    owner = np.array(prefix_of, dtype=np.int64)
    prefix_start = np.where(owner >= 0, q_start[owner], 0)  # (owner -1 indexes the last segment; masked out)
    prefix_len = np.where(owner >= 0, q_len[owner], 0)
    k_len = prefix_len + q_len
    # each segment's keys: its prefix's token positions in the pack, then its own
    key_index = concat_ranges(np.stack([prefix_start, q_start], 1).ravel(), np.stack([prefix_len, q_len], 1).ravel())
    positions = concat_ranges(np.array(position_start, dtype=np.int64), q_len)
    return SharedLayout(input_ids=to_device(flat_ids(tokens, total), device)[None],
                        position_ids=to_device(positions, device)[None],
                        cu_q=to_device(np.concatenate([[0], q_end]).astype(np.int32), device),
                        cu_k=to_device(np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32), device),
                        key_index=to_device(key_index, device), max_q=int(q_len.max()), max_k=int(k_len.max()),
                        last=to_device(q_end[np.array(last_segment)] - 1, device), computed=total,
                        saved=sum(len(r) for r in batch) - total)
