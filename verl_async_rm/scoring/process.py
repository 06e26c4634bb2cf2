"""Process reward models (PRMs): one score per reasoning step, read at a separator token after each step.

As the public PRMs do (Qwen2.5-Math-PRM's model card): the steps joined and ended by the separator, rendered with the
RM's chat template; at every separator the probability of the "correct" label is the step's score. Each step maps back
to the policy's response token where it ends, from character offsets in the decoded response (so whatever the RM's
tokenizer is). An input longer than ``max_length`` loses the start of the prompt, then its first steps
(:attr:`ProcessInput.dropped`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import RewardInputError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.judge_text import Verdict
from verl_async_rm.scoring.inputs import (
    check_token_ids,
    conversation_for,
    dedup_bos,
    render_conversation,
    strip_trailing,
    truncate_left,
)

__all__ = ["Score", "score_value", "StepRewards", "ProcessInput", "split_steps", "step_token_ends",
           "prepare_process_input", "reduce_steps"]


@dataclass(frozen=True)
class StepRewards:
    """A process RM's token-level reward for one trajectory (``process_reduction='none'``): one score per scored
    step, the response token where each step ends, and the leading steps ``max_length`` left unscored."""

    scores: tuple[float, ...]
    token_index: tuple[int, ...]
    dropped: int = 0

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.token_index):
            raise ValueError("StepRewards needs one token index per score")

    @property
    def total(self) -> float:
        """The trajectory's reward: the sum of its step rewards (what verl's ``rm_scores.sum(-1)`` gives)."""
        return sum(self.scores, 0.0)


#: What an RM hands back for one trajectory, from the replica to the reward mix: its score (a finite float, converted
#: once by the forward's ``.tolist()`` and checked once by the scorer), a token-level process RM's step rewards, or a
#: judge's parsed verdict with its text.
Score = float | StepRewards | Verdict


def score_value(score: Score) -> float:
    """The trajectory-level value of a score: the float itself, the sum of the step rewards, or the verdict's score."""
    if isinstance(score, StepRewards):
        return score.total
    return score.score if isinstance(score, Verdict) else score


@dataclass(frozen=True)
class ProcessInput:
    """One trajectory's PRM input: the RM's ids, the separator positions read (one per kept step), the response
    token where each kept step ends, the leading steps cut by ``max_length``, and whether ``ids`` were cut."""

    ids: list[int]
    positions: list[int]
    token_index: list[int]
    dropped: int
    truncated: bool


def split_steps(text: str, delimiter: str) -> list[tuple[str, int]]:
    """``(step, end)`` for every non-empty step of ``text`` (``end``: the offset just past the step in ``text``).

    Whitespace-only pieces are skipped; no delimiter gives one step; a text with no non-empty piece gives one step,
    the whole text.
    """
    steps: list[tuple[str, int]] = []
    start = 0
    for piece in text.split(delimiter):
        if piece.strip():
            steps.append((piece, start + len(piece)))
        start += len(piece) + len(delimiter)
    return steps or [(text, len(text))]


def step_token_ends(tokenizer: Any, ids: Sequence[int], char_ends: Iterable[int]) -> list[int]:
    """For each character offset, the first token of ``ids`` whose decoded prefix reaches it (binary search over
    prefix decodes: ``log2(len(ids))`` decodes per offset). An offset of 0 maps to token 0."""
    ids = list(ids)
    cache: dict[int, int] = {}

    def decoded(n: int) -> int:
        if n not in cache:
            cache[n] = len(tokenizer.decode(ids[:n], skip_special_tokens=False))
        return cache[n]

    out = []
    for end in char_ends:
        low, high = 1, len(ids)  # the smallest n with decoded(n) >= end; the token is n - 1
        while low < high:
            mid = (low + high) // 2
            if decoded(mid) >= end:
                high = mid
            else:
                low = mid + 1
        out.append(max(low - 1, 0))
    return out


def prepare_process_input(
    request: RMRequest,
    *,
    rm_tokenizer: Any,
    policy_tokenizer: Any,
    delimiter: str,
    separator: str,
    separator_id: int,
    response_stop_ids: Iterable[int] | None = None,
    max_length: int | None = None,
    id_limit: int | None = None,
) -> ProcessInput:
    """The PRM input of one single-turn trajectory; ``RewardInputError`` for no ``raw_prompt``, a multi-turn
    trajectory, a response that contains the separator, or a rendering without one separator per step."""
    if request.messages is not None or request.num_turns > 2:
        raise RewardInputError(
            f"trajectory {request.uid}: a process RM scores the steps of one response; multi-turn trajectories "
            "(messages or num_turns > 2) are not supported"
        )
    if id_limit is not None:
        check_token_ids(request, "response_ids", id_limit, "the policy tokenizer's vocabulary")
    if response_stop_ids is None:
        response_stop_ids = {policy_tokenizer.eos_token_id, policy_tokenizer.pad_token_id} - {None}
    response = strip_trailing(request.response_ids, response_stop_ids)
    text = policy_tokenizer.decode(response, skip_special_tokens=False)
    if separator in text:
        raise RewardInputError(
            f"trajectory {request.uid}: the response contains the step separator {separator!r}, so its steps "
            "cannot be told apart from the separators the PRM reads"
        )
    steps = split_steps(text, delimiter)
    if response:
        token_index = step_token_ends(policy_tokenizer, response, (end for _, end in steps))
    else:  # nothing but stop tokens: the one (empty) step ends on the last response token
        token_index = [max(len(request.response_ids) - 1, 0)]
    content = separator.join(step for step, _ in steps) + separator
    rendered = render_conversation(conversation_for(request, content), rm_tokenizer)
    ids = dedup_bos(list(rm_tokenizer(rendered, add_special_tokens=False)["input_ids"]), rm_tokenizer.bos_token_id)
    found = [j for j, t in enumerate(ids) if t == separator_id]
    if len(found) < len(steps):
        raise RewardInputError(
            f"trajectory {request.uid}: {len(steps)} step(s) but {len(found)} separator token(s) after rendering "
            f"with the RM's chat template; the template must keep the assistant content as it is"
        )
    positions = found[len(found) - len(steps) :]  # a prompt may hold the separator too: the steps' are the last
    bos_id = rm_tokenizer.bos_token_id
    full_length, starts_with_bos = len(ids), bos_id is not None and ids[0] == bos_id
    ids, truncated = truncate_left(ids, max_length, bos_id)
    dropped = 0
    if truncated:  # truncate_left kept a leading BOS (``lead``) and the last len(ids) - lead tokens
        lead = int(starts_with_bos and len(ids) >= 2)
        kept_from = full_length - (len(ids) - lead)
        kept = [k for k, p in enumerate(positions) if p >= kept_from]
        dropped = len(positions) - len(kept)
        positions = [positions[k] - kept_from + lead for k in kept]
        token_index = [token_index[k] for k in kept]
    if not positions:
        raise RewardInputError(
            f"trajectory {request.uid}: max_length={max_length} leaves no step of the response to score"
        )
    return ProcessInput(ids=ids, positions=positions, token_index=token_index, dropped=dropped, truncated=truncated)


def reduce_steps(scores: Sequence[float], reduction: str) -> float:
    """One outcome score from step scores (Python floats already): ``min``, ``mean``, ``last`` or ``product``."""
    if not scores:
        raise ValueError("no step scores to reduce")
    if reduction == "min":
        return min(scores)
    if reduction == "mean":
        return sum(scores) / len(scores)
    if reduction == "last":
        return scores[-1]
    if reduction == "product":
        return math.prod(scores)
    raise ValueError(f"unknown process_reduction {reduction!r}")
