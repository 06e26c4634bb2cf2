"""Token-level rewards of process RMs (``process_reduction='none'``): each step's score on the response token where
it ends, in verl's ``rm_scores``, summing to the reward. v1: the output becomes a :class:`TokenRewardOutput`; v0: the
placement travels in ``extra_fields`` and :func:`place_token_rewards` rewrites the batch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

from verl_async_rm.request import StepRewards

__all__ = ["TOKEN_REWARDS_KEY", "token_placement", "TokenRewardOutput", "with_token_rewards", "place_token_rewards"]

#: ``extra_fields`` key of the placement on v0 (``[(response token index, reward), ...]``).
TOKEN_REWARDS_KEY = "rm_token_rewards"
#: A rest of the reward smaller than this (relative) is the rounding of the weighted steps' sum, below float32's
#: resolution in ``rm_scores``: it is not placed on the last token.
_RESOLUTION = 1e-7


def token_placement(reward: float, scores: Mapping[str, Any], weights: Mapping[str, float],
                    response_length: int) -> list[tuple[int, float]]:
    """``[(response token index, value), ...]`` whose values sum to ``reward``: each token-level RM's step scores
    (its :class:`StepRewards`) times its weight at their tokens (steps ending on one token add up), the rest (verl's
    rule, outcome RMs) on the last response token."""
    last = max(response_length - 1, 0)
    placed: dict[int, float] = {}
    for name, rewards in scores.items():
        if not isinstance(rewards, StepRewards):
            continue
        for index, score in zip(rewards.token_index, rewards.scores, strict=True):
            index = min(index, last)
            placed[index] = placed.get(index, 0.0) + weights[name] * score
    rest = reward - math.fsum(placed.values())
    if abs(rest) > _RESOLUTION * max(1.0, abs(reward)):  # not a rounding residue of the steps' own sum
        placed[last] = placed.get(last, 0.0) + rest
    return sorted(placed.items())


class TokenRewardOutput(AgentLoopOutput):
    """verl's ``AgentLoopOutput`` whose ``rm_scores`` hold a token-level placement instead of one value at the end."""

    token_rewards: list[tuple[int, float]] = []

    def as_dict(self) -> dict[str, Any]:
        output = super().as_dict()
        output.pop("token_rewards", None)
        output["rm_scores"] = _row(output["response_mask"], self.token_rewards)
        return output


def with_token_rewards(output: AgentLoopOutput, placement: list[tuple[int, float]]) -> TokenRewardOutput:
    """``output`` as a :class:`TokenRewardOutput` with ``placement`` (its fields, and which of them were set, kept:
    verl dumps only the set ones)."""
    fields = {name: getattr(output, name) for name in type(output).model_fields}
    return TokenRewardOutput.model_construct(
        _fields_set=set(output.model_fields_set), **fields, token_rewards=list(placement))


def place_token_rewards(output: Any) -> int:
    """v0: rewrite the ``rm_scores`` rows of a verl ``DataProto`` whose trajectories carry a placement (in
    ``extra_fields``, now a non-tensor column, removed here); returns how many rows were rewritten."""
    column = output.non_tensor_batch.pop(TOKEN_REWARDS_KEY, None)
    if column is None:
        return 0
    scores = output.batch["rm_scores"].clone()  # the column assigned whole: a DataProto view may hand out copies
    rows = 0
    for i, placement in enumerate(column):
        if placement is None or any(np.isnan(v) for _, v in placement):
            continue  # no RM placement (a dropped trajectory keeps verl's own NaN row for apply_drops)
        scores[i] = _row(scores[i], placement)
        rows += 1
    output.batch["rm_scores"] = scores
    return rows


def _row(like: torch.Tensor, placement: list[tuple[int, float]]) -> torch.Tensor:
    row = torch.zeros_like(like, dtype=torch.float32)
    for index, value in placement:
        row[int(index)] += float(value)
    return row
