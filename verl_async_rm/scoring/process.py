"""The process kind (PRM, Qwen2.5-Math-PRM's recipe): the steps joined and ended by a separator token, rendered with
the RM's chat template; each separator's "correct" probability is its step's score, placed on the response token
where the step ends. A long input loses its prompt's start, then its first steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from verl_async_rm.errors import ConfigValueError, NonFiniteScoreError, RewardInputError
from verl_async_rm.request import RMRequest, ScoreResult, StepRewards
from verl_async_rm.scoring.inputs import (check_token_ids, conversation_for, dedup_bos, render_conversation,
                                          strip_trailing, truncate_left)
from verl_async_rm.scoring.markup import hide_markup, hide_messages, markup_ids
from verl_async_rm.scoring.outcome import OutcomeKind, RMInput, find_head

__all__ = ["ProcessKind", "StepRewards", "split_steps", "step_token_ends", "reduce_steps"]


class ProcessKind(OutcomeKind):
    """A process RM: its input is always rendered (steps and separators), a value is read at every separator, and
    the score is their reduction (``process_reduction``), or with ``'none'`` the :class:`StepRewards` themselves."""

    name = "process"
    renders = True

    @staticmethod
    def check(config: Any) -> None:
        if not config.step_separator:
            raise ConfigValueError(
                "step_separator", config.step_separator, "a process RM needs the token it reads each step's score "
                "at", "set it to the PRM's step token, e.g. +async_rm.step_separator='<extra_0>' for Qwen2.5-Math-PRM")
        if config.retemplate == "never":
            raise ConfigValueError("retemplate", "never", "a process RM's input is always re-rendered, with a "
                                   "separator after each step", "use retemplate='auto' (the default)")
        if config.score_output_field is not None:
            raise ConfigValueError(
                "score_output_field", config.score_output_field, "a process RM is read from its per-token logits at "
                "each step separator, not from an output field", "remove score_output_field, or set "
                "reward_kind='outcome'")

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int) -> None:
        super().__init__(config, rm_tokenizer, text_config, vocab_size)
        self.suffix_ids = []
        separator = config.step_separator
        ids = rm_tokenizer(separator, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] >= vocab_size:
            raise ConfigValueError(
                "step_separator", separator, f"the RM's tokenizer ({config.model_path}) reads it as {len(ids)} "
                f"token(s) {ids}, so the PRM has no single position to score each step at", "set it to the PRM's own "
                "step token (one special token of its vocabulary, e.g. '<extra_0>' for Qwen2.5-Math-PRM)")
        self.separator_id = int(ids[0])

    def transformers_readout(self, model: Any) -> dict[str, Any]:
        self.head_name, head = find_head(model, self.config.score_head)
        labels, index = int(model.config.num_labels), self.config.process_label_index
        if not 0 <= index < labels:
            raise ConfigValueError("process_label_index", index, f"the process RM has {labels} label(s)",
                                   f"use an index in [0, {labels - 1}] (1 is 'correct' for two-label PRMs)")
        return {"head": head, "label_index": index}

    def build(self, request: RMRequest) -> RMInput:
        """The PRM input of one single-turn trajectory; ``RewardInputError`` for no ``raw_prompt``, a multi-turn
        trajectory, a response that contains the separator, or a rendering without one separator per step."""
        separator = self.config.step_separator
        if request.messages is not None or request.num_turns > 2:
            raise RewardInputError(
                f"trajectory {request.uid}: a process RM scores the steps of one response; multi-turn trajectories "
                "(messages or num_turns > 2) are not supported")
        if self.policy_id_limit is not None:
            check_token_ids(request, "response_ids", self.policy_id_limit, "the policy tokenizer's vocabulary")
        response = strip_trailing(request.response_ids, self.response_stop_ids)
        text = self.policy_tokenizer.decode(response, skip_special_tokens=False)
        if separator in text:
            raise RewardInputError(
                f"trajectory {request.uid}: the response contains the step separator {separator!r}, so its steps "
                "cannot be told apart from the separators the PRM reads")
        steps = split_steps(text, self.config.step_delimiter)
        if response:
            token_index = step_token_ends(self.policy_tokenizer, response, (end for _, end in steps))
        else:  # nothing but stop tokens: the one (empty) step ends on the last response token
            token_index = [max(len(request.response_ids) - 1, 0)]
        # the prompt and each step as text (markup.py); the separators between them are the ones read
        tokenizer = self.rm_tokenizer
        content = separator.join(hide_markup(step, tokenizer) for step, _ in steps) + separator
        *prompt, answer = conversation_for(request, content)
        rendered = render_conversation([*hide_messages(prompt, tokenizer), answer], tokenizer)
        bos_id = tokenizer.bos_token_id
        ids = dedup_bos(markup_ids(rendered, tokenizer), bos_id)
        found = [j for j, t in enumerate(ids) if t == self.separator_id]
        if len(found) < len(steps):
            raise RewardInputError(
                f"trajectory {request.uid}: {len(steps)} step(s) but {len(found)} separator token(s) after rendering "
                f"with the RM's chat template; the template must keep the assistant content as it is")
        positions = found[len(found) - len(steps) :]  # a prompt may hold the separator too: the steps' are the last
        full_length, starts_with_bos = len(ids), bos_id is not None and ids[0] == bos_id
        ids, truncated = truncate_left(ids, self.max_length, bos_id)
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
                f"trajectory {request.uid}: max_length={self.max_length} leaves no step of the response to score")
        return RMInput(ids, truncated, reads=positions, token_index=token_index, dropped=dropped)

    def read(self, request: RMRequest, value: Any, built: RMInput) -> ScoreResult:
        if not all(math.isfinite(v) for v in value):
            return NonFiniteScoreError(f"trajectory {request.uid}: the RM returned {value}")
        if self.config.process_reduction == "none":
            return StepRewards(tuple(value), tuple(built.token_index or ()), built.dropped)
        return reduce_steps(value, self.config.process_reduction)


def split_steps(text: str, delimiter: str) -> list[tuple[str, int]]:
    """``(step, end offset)`` of every non-empty step of ``text``; the whole text when none."""
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


#: ``process_reduction``: step scores (Python floats already) to one outcome score.
_REDUCTIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "min": min, "mean": lambda s: sum(s) / len(s), "last": lambda s: s[-1], "product": math.prod}


def reduce_steps(scores: Sequence[float], reduction: str) -> float:
    """One outcome score from step scores: ``min``, ``mean``, ``last`` or ``product``."""
    if not scores:
        raise ValueError("no step scores to reduce")
    return _REDUCTIONS[reduction](scores)
