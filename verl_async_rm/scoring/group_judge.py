"""The group judge (``reward_kind='group_judge'``): one judge call scores every response of a GRPO group side by side.

The judge reads ``judge_prompt`` (Jinja: ``prompt``, the last user turn; ``messages``; ``ground_truth``; and
``responses``: each response as a reader sees it, in a block of its own that carries its label, in label order, blocks
separated by one blank line)::

    <response label="1">
    The farmer has 57 apples.
    </response>

    <response label="2">
    72 apples.
    </response>

A response's text is escaped so that the judge's input holds exactly one block per response: the ``<`` of any tag in it
whose name starts with ``response``, ``question`` or ``reference`` (any case or spacing, a closing ``/``, or a bracket
that looks like ``<``) is written as its HTML character reference (``&lt;/response>``, :func:`~.markup.escape_tags`), so
a response can neither close its block nor open one under another label; the other values (the question, the reference
answer) are escaped the same way, and, locally, a special token's string in any of them stays text (:mod:`~.markup`).

Which response gets which label is a permutation drawn from ``judge_seed`` and the group's id (a stable hash, the same
in every process and run), over the members in the order of their ids, so no response is always first and a re-ask shows
the same labels. The judge replies with a JSON object mapping each label to a number; where the engine can, the reply is
constrained to that schema (:func:`reply_schema`). Each member's score is its label's number divided by ``judge_scale``.
A reply that is not such an object (a label missing, repeated or unknown, a value that is not a finite number) fails the
whole group (:class:`JudgeVerdictError` with the reply), never a score standing in; a group longer than the judge's
context fails whole too (:class:`RewardInputError`), never cut.

The kind (:class:`GroupJudgeKind`) runs on a replica's vLLM engine or at an endpoint (chat completions, the reply's
schema as ``response_format``); a reply cut at ``judge_max_tokens`` is never read."""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from verl_async_rm.errors import ConfigValueError, JudgeVerdictError, RewardInputError
from verl_async_rm.request import GroupRequest, GroupVerdict, ScoreResult
from verl_async_rm.scoring.engine import Generated
from verl_async_rm.scoring.judge import (VERDICT_CHARS, as_content, chat_ids, check_whole, compile_prompt,
                                         judge_messages, prompt_values, refuse_never, reply_room, response_text)
from verl_async_rm.scoring.markup import escape_tags
from verl_async_rm.scoring.outcome import Kind, RMInput
from verl_async_rm.scoring.pairwise import last_json_object

logger = logging.getLogger(__name__)

__all__ = ["GroupJudgeKind", "DEFAULT_GROUP_PROMPT", "GROUP_VARIABLES", "group_labels", "member_labels", "group_text",
           "render_responses", "reply_schema", "reply_form", "parse_group_reply", "group_verdict", "long_group_error"]

#: The variables of a group judge's ``judge_prompt``.
GROUP_VARIABLES = ("prompt", "messages", "responses", "ground_truth")
DEFAULT_GROUP_PROMPT = (
    "Here is a question{% if ground_truth %}, a reference answer{% endif %} and several responses to it, each between "
    "tags; each response's tag carries its label.\n\n<question>\n{{ prompt }}\n</question>\n{% if ground_truth %}\n"
    "<reference_answer>\n{{ ground_truth }}\n</reference_answer>\n{% endif %}\n{{ responses }}\n\n"
    "Compare the responses with each other and grade each from 0 (wrong or useless) to 10 (correct and complete). "
    'Reply with only a JSON object that maps each label to its grade, e.g. {"1": 7, "2": 3}.'
)
#: Keys a group judge has no use for, and why.
_REFUSED = {
    "judge_tokens": "a group judge's reply is read as text (a JSON object of numbers), not at its next token",
    "judge_pattern": "a group judge's reply is a JSON object mapping each label to a number, read as such",
    "judge_labels": "a group judge's reply is a JSON object mapping each label to a number, read as such",
    "score_output_field": "a group judge is read from the JSON object it writes",
}


def group_labels(group: str, count: int, seed: int) -> list[int]:
    """The labels 1..``count``, shuffled by ``seed`` and ``group`` alone (SHA-256, not Python's salted ``hash``)."""
    digest = hashlib.sha256(f"{seed}\0{group}".encode()).digest()
    labels = list(range(1, count + 1))
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(labels)
    return labels


def render_responses(texts: Sequence[str], labels: Sequence[int]) -> str:
    """``{{ responses }}``: each text between the lines ``<response label="<label>">`` and ``</response>``, its own
    tags of those names escaped (:func:`~.markup.escape_tags`), in label order, blocks separated by one blank line:
    exactly ``len(texts)`` blocks, whatever the texts hold."""
    return "\n\n".join(f'<response label="{label}">\n{escape_tags(text)}\n</response>'
                        for label, text in sorted(zip(labels, texts, strict=True)))


def member_labels(group: GroupRequest, seed: int) -> tuple[int, ...]:
    """Each member's label, in the members' order: :func:`group_labels` dealt over the members sorted by id, so the
    labels do not depend on the order they arrived in."""
    order = sorted(range(len(group.members)), key=lambda i: group.members[i].uid)
    drawn = group_labels(group.group, len(order), seed)
    labels = [0] * len(order)
    for position, member in enumerate(order):
        labels[member] = drawn[position]
    return tuple(labels)


def group_text(group: GroupRequest, *, template: Any, policy_tokenizer: Any, response_stop_ids: Iterable[int],
               id_limit: int | None, seed: int, escape: Callable[[str], str] | None = None
               ) -> tuple[str, tuple[int, ...]]:
    """The judge's user turn for ``group`` (``judge_prompt`` rendered with its responses under their labels) and each
    member's label; every value content (:func:`~.judge.as_content`, with ``escape``). The question is the first
    member's (every member of a group answers the same prompt)."""
    stop_ids = list(response_stop_ids)
    texts = [as_content(response_text(m, policy_tokenizer=policy_tokenizer, response_stop_ids=stop_ids,
                                       id_limit=id_limit), escape) for m in group.members]
    labels = member_labels(group, seed)
    text = template.render(responses=render_responses(texts, labels), **prompt_values(group.members[0], escape))
    return text, labels


def reply_schema(count: int) -> dict[str, Any]:
    """The JSON schema of a reply for labels 1..``count``: an object whose properties are exactly the labels, each a
    number."""
    keys = [str(label) for label in range(1, count + 1)]
    return {"type": "object", "properties": {key: {"type": "number"} for key in keys}, "required": keys,
            "additionalProperties": False}


def reply_form(count: int) -> str:
    """What a re-ask tells a group judge its reply must look like."""
    keys = ", ".join(f'"{label}"' for label in range(1, count + 1))
    return f"reply with only a JSON object whose keys are exactly the labels {keys}, each mapped to a number"


def parse_group_reply(text: str, count: int) -> dict[int, float]:
    """The number the judge gave each label 1..``count``: the last JSON object in ``text`` (code fences and words
    around it are allowed; keys may be written ``"1"`` or ``"[1]"``). ``ValueError`` with the reason when there is no
    object, a label is missing, repeated or unknown, or a value is not a finite number."""
    pairs = last_json_object(text)
    values: dict[int, float] = {}
    for key, value in pairs:
        name = str(key).strip().removeprefix("[").removesuffix("]").strip()
        label = int(name) if name.isdecimal() else None
        if label is None or not 1 <= label <= count:
            raise ValueError(f"{key!r} is not one of the labels 1-{count}")
        if label in values:
            raise ValueError(f"label {label} is given twice")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"label {label}'s value {value!r} is not a number")
        if not math.isfinite(value):
            raise ValueError(f"label {label}'s value {value!r} is not a finite number")
        values[label] = float(value)
    missing = [label for label in range(1, count + 1) if label not in values]
    if missing:
        raise ValueError(f"label{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                         f"{'are' if len(missing) > 1 else 'is'} missing")
    return values


def group_verdict(group: GroupRequest, labels: Sequence[int], text: str, scale: float, where: str
                  ) -> GroupVerdict | JudgeVerdictError:
    """The group's scores from the judge's reply ``text`` (each label's number / ``scale``, in the members' order), or
    the :class:`JudgeVerdictError` that fails the group (``where``, then why; ``reply``: the text)."""
    try:
        values = parse_group_reply(text, len(labels))
    except ValueError as err:
        shown = text[-VERDICT_CHARS:]
        return JudgeVerdictError(f"{where}the judge's reply does not read: {err} (the reply"
                                 f"{' ends' if len(text) > VERDICT_CHARS else ''}: {shown!r})", reply=text,
                                 reason=str(err))
    kept = [f"[{label}] " for label in labels]  # each member's label, then the reply's end
    return GroupVerdict(tuple(values[label] / scale for label in labels),
                        tuple(k + text[-(VERDICT_CHARS - len(k)):] for k in kept))


class GroupJudgeKind(Kind[GroupRequest]):
    """A group judge: one input per :class:`GroupRequest`, text constrained to :func:`reply_schema`, read by
    :func:`group_verdict`."""

    name = "group_judge"
    renders = True
    needs_vllm = True

    @staticmethod
    def check(config: Any) -> None:
        """Keys a group judge has no use for refused; the default prompt filled in; ``judge_prompt`` compiled."""
        for key, why in _REFUSED.items():
            if getattr(config, key) is not None:
                raise ConfigValueError(key, getattr(config, key), why, "remove it")
        if config.judge_readout == "logits":
            raise ConfigValueError("judge_readout", "logits", "a group judge writes its reply (vLLM generate locally, "
                                   "chat completions at an endpoint); nothing is read at its next token",
                                   "remove judge_readout")
        refuse_never(config)
        object.__setattr__(config, "judge_readout", "generate")
        if config.judge_prompt is None:
            object.__setattr__(config, "judge_prompt", DEFAULT_GROUP_PROMPT)
        compile_prompt(config.judge_prompt, GROUP_VARIABLES)

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int | None) -> None:
        super().__init__(config, rm_tokenizer, text_config, vocab_size)
        self._require_chat_template()
        self.head_name = "generate -> JSON object by label"
        self.template = compile_prompt(config.judge_prompt, GROUP_VARIABLES)
        #: The input's tokens at most: the reply must fit in the engine's context too.
        self.room = reply_room(config, self.max_length)
        self._warned_long = False

    def messages(self, group: GroupRequest) -> tuple[list[dict[str, str]], tuple[int, ...]]:
        """The judge's conversation for ``group`` (a re-ask's turns after the first) and each member's label; its
        its values escaped (:attr:`~.outcome.Kind.escape`)."""
        text, labels = group_text(group, template=self.template, policy_tokenizer=self.policy_tokenizer,
                                  response_stop_ids=self.response_stop_ids, id_limit=self.policy_id_limit,
                                  seed=self.config.judge_seed, escape=self.escape)
        return judge_messages(text, group.reask, reply_form(len(labels)), escape=self.escape), labels

    def build(self, group: GroupRequest) -> RMInput:
        messages, labels = self.messages(group)
        if self.rm_tokenizer is None:  # at an endpoint, no checkpoint here: the server renders them, counts the rest
            return RMInput(None, schema=reply_schema(len(labels)), messages=messages)
        ids = chat_ids(messages, self.rm_tokenizer)
        if self.room is not None and len(ids) > self.room:
            error = long_group_error(group, len(ids), self.max_length, self.config.judge_max_tokens)
            if not self._warned_long:
                self._warned_long = True
                logger.error("%s", error)
            raise error
        return RMInput(ids, schema=reply_schema(len(labels)), messages=messages)

    def read(self, group: GroupRequest, value: Generated, built: RMInput) -> ScoreResult:
        where = f"group judge {self.config.model_path or self.config.endpoint}: {group.uid}: "
        try:
            check_whole(value, self.config.judge_max_tokens, where)
        except JudgeVerdictError as err:
            return err
        labels = member_labels(group, self.config.judge_seed)
        return group_verdict(group, labels, value.text, self.config.judge_scale, where)


def long_group_error(group: GroupRequest, tokens: int, max_length: int | None, reply_tokens: int) -> RewardInputError:
    """The error of a group whose judge input is longer than ``max_length - judge_max_tokens``: how long, which limit,
    the fix (a group judge's input is never cut: that would cut a response, or the instructions)."""
    return RewardInputError(
        f"{group.uid}: the group judge's input is {tokens} tokens, more than the {max_length} - {reply_tokens} = "
        f"{(max_length or 0) - reply_tokens} it may take (max_length={max_length} holds the input and the reply of "
        f"judge_max_tokens={reply_tokens}); the whole group fails, since cutting would drop part of a response. Fix: "
        "raise max_length (up to the judge's context), lower judge_max_tokens, shorten judge_prompt or "
        "data.max_response_length, or use a smaller actor_rollout_ref.rollout.n")
