"""Trajectories into RM input (:func:`prepare_input_ids`: re-rendered with the RM's chat template, every content as
text (:mod:`~.markup`), or the policy's ids reused; cut from the left, keeping the response's end where the score is
read) and inputs into micro-batches (:func:`plan_micro_batches`, :func:`plan_packed_micro_batches`). Pure functions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from verl_async_rm.errors import RewardInputError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.markup import hide_messages, markup_ids

__all__ = ["tokenizers_match", "strip_trailing", "conversation_for", "render_conversation", "dedup_bos",
           "truncate_left", "check_token_ids", "prepare_input_ids", "plan_micro_batches", "plan_packed_micro_batches",
           "first_fit"]


def tokenizers_match(policy_tokenizer: Any, rm_tokenizer: Any) -> bool:
    """True when the policy's token ids mean the same text, in the same chat format, to the RM."""
    return (
        policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab()
        and getattr(policy_tokenizer, "chat_template", None) == getattr(rm_tokenizer, "chat_template", None)
        and policy_tokenizer.bos_token_id == rm_tokenizer.bos_token_id
        and policy_tokenizer.eos_token_id == rm_tokenizer.eos_token_id
    )


def strip_trailing(ids: Sequence[int], drop: Iterable[int]) -> list[int]:
    """``ids`` without its trailing run of ids in ``drop`` (end-of-sequence and pad ids of a response)."""
    drop = set(drop)
    end = len(ids)
    while end > 0 and ids[end - 1] in drop:
        end -= 1
    return list(ids[:end])


def conversation_for(request: RMRequest, response_text: str | None) -> list[dict[str, Any]]:
    """The chat messages to render for ``request``: its ``messages``, else ``raw_prompt`` + the response turn."""
    if request.messages is not None:
        return list(request.messages)
    if request.num_turns > 2:
        raise RewardInputError(
            f"trajectory {request.uid}: multi-turn trajectory (num_turns={request.num_turns}) cannot be re-rendered "
            "with the RM's chat template from its token ids; pass RMRequest.messages (the whole conversation), or "
            "use an RM with the policy's tokenizer and template")
    if not request.raw_prompt:
        raise RewardInputError(
            f"trajectory {request.uid}: raw_prompt is missing; it is needed to re-render the conversation with the "
            "RM's chat template, because the RM's tokenizer or template differs from the policy's. verl's "
            "RLHFDataset always provides it: a custom dataset or agent loop must keep the prompt's chat messages "
            "under 'raw_prompt' (or pass RMRequest.messages)")
    assert response_text is not None, "the response must be decoded before it can be appended"
    return [*request.raw_prompt, {"role": "assistant", "content": response_text}]


def render_conversation(messages: list[dict[str, Any]], rm_tokenizer: Any) -> str:
    """The conversation rendered as text by the RM's chat template (no generation prompt)."""
    text = rm_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if not isinstance(text, str):  # some templates return a list for batched input
        raise RewardInputError(f"the RM's chat template returned {type(text).__name__}, expected a string")
    return text


def dedup_bos(ids: list[int], bos_id: int | None) -> list[int]:
    """``ids`` with a repeated leading BOS reduced to one."""
    if bos_id is None:
        return ids
    start = 0
    while start + 1 < len(ids) and ids[start] == bos_id and ids[start + 1] == bos_id:
        start += 1
    return ids[start:]


def truncate_left(ids: list[int], max_length: int | None, bos_id: int | None = None) -> tuple[list[int], bool]:
    """The last ``max_length`` tokens (a leading BOS kept in front), and whether anything was cut."""
    if max_length is None or len(ids) <= max_length:
        return ids, False
    if bos_id is not None and ids and ids[0] == bos_id and max_length >= 2:
        return [bos_id, *ids[len(ids) - (max_length - 1) :]], True
    return ids[len(ids) - max_length :], True


def prepare_input_ids(request: RMRequest, *, rm_tokenizer: Any, policy_tokenizer: Any | None, retemplate: bool,
                      response_stop_ids: Iterable[int] | None = None, max_length: int | None = None,
                      id_limit: int | None = None, suffix_ids: Sequence[int] = ()) -> tuple[list[int], bool]:
    """The RM's input ids for one trajectory and whether they were cut (``RewardInputError`` when there are none).
    ``id_limit``: ids must lie in ``[0, id_limit)`` (the policy's vocabulary when decoded, the RM's embedding when
    reused); ``suffix_ids`` (a reward token) are appended after truncation, within ``max_length``."""
    bos_id = rm_tokenizer.bos_token_id
    if not retemplate:
        if id_limit is not None:
            check_token_ids(request, "prompt_ids", id_limit, "the RM's embedding table")
            check_token_ids(request, "response_ids", id_limit, "the RM's embedding table")
        ids = [*request.prompt_ids, *request.response_ids]
    else:
        response_text = None
        if request.messages is None:
            if id_limit is not None:
                check_token_ids(request, "response_ids", id_limit, "the policy tokenizer's vocabulary")
            assert policy_tokenizer is not None, "re-templating needs the policy tokenizer"
            if response_stop_ids is None:
                response_stop_ids = {policy_tokenizer.eos_token_id, policy_tokenizer.pad_token_id} - {None}
            response = strip_trailing(request.response_ids, response_stop_ids)
            response_text = policy_tokenizer.decode(response, skip_special_tokens=False)
        # every content as text (a special token's string the prompt or response spells, or the string of a special id
        # the policy wrote mid-response, decoded above): the template alone writes the RM's control tokens
        messages = hide_messages(conversation_for(request, response_text), rm_tokenizer)
        ids = dedup_bos(markup_ids(render_conversation(messages, rm_tokenizer), rm_tokenizer), bos_id)
    if not ids:
        raise RewardInputError(f"trajectory {request.uid}: empty RM input (no prompt and no response tokens)")
    room = None if max_length is None else max(max_length - len(suffix_ids), 1)
    ids, cut = truncate_left(ids, room, bos_id)
    return [*ids, *suffix_ids], cut


def check_token_ids(request: RMRequest, name: str, limit: int, vocabulary: str) -> None:
    """Raise :class:`RewardInputError` if ``request.<name>`` holds an id outside ``[0, limit)`` (else silently
    dropped when decoded, or an index error failing a whole micro-batch inside the embedding)."""
    ids = getattr(request, name)
    bad = next((t for t in ids if not 0 <= t < limit), None)
    if bad is not None:
        raise RewardInputError(
            f"trajectory {request.uid}: {name} holds token id {bad}, outside {vocabulary} ({limit} ids). The ids "
            "come from another vocabulary than the one they are read with: check that the policy tokenizer "
            "(actor_rollout_ref.model.tokenizer_path / path) is the one the rollout used, and that retemplate is "
            "not 'never' for an RM with its own vocabulary")


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group indices, longest first (little padding), into micro-batches whose padded size (rows x longest row)
    stays within ``max_tokens``; an input longer than the budget runs alone."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens!r}: must be positive")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        # sorted longest first: a micro-batch's first row is its longest, and sets its width
        if not batches or max(lengths[batches[-1][0]], 1) * (len(batches[-1]) + 1) > max_tokens:
            batches.append([])
        batches[-1].append(i)
    return batches


def plan_packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group indices into packed forwards whose real tokens stay within ``max_tokens``, first-fit decreasing (few,
    nearly full forwards); an input longer than the budget runs alone."""
    return first_fit([(max(n, 1), [i]) for i, n in enumerate(lengths)], max_tokens)


def first_fit(units: list[tuple[int, list[int]]], max_tokens: int) -> list[list[int]]:
    """Place ``(cost, indices)`` units, costliest first, each into the first micro-batch it fits in."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens!r}: must be positive")
    batches: list[list[int]] = []
    room: list[int] = []  # tokens left in each batch
    for cost, rows in sorted(units, key=lambda unit: unit[0], reverse=True):
        fit = next((b for b, left in enumerate(room) if cost <= left), None)
        if fit is None:
            batches.append(list(rows))
            room.append(max_tokens - cost)
        else:
            batches[fit].extend(rows)
            room[fit] -= cost
    return batches
