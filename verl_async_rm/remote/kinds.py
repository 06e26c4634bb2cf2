"""What a remote RM is asked for one trajectory and how its answer becomes the trajectory's score, per kind:

- a judge that writes its verdict (``judge_readout='generate'``): chat completions, greedy (temperature 0), at most
  ``judge_max_tokens``; the verdict parsed by ``judge_pattern`` / ``judge_labels`` (:func:`~.judge.parse_verdict`);
- a judge read at its first token (``logits``): chat completions of one token with the first token's
  log-probabilities (``top_logprobs``): the first judge token's probability among ``judge_tokens``, as the local
  readout computes it (a softmax over those tokens' logits equals one over their log-probabilities);
- an outcome RM: vLLM's classify endpoint (``/classify``, at the server's root), the head's raw output
  (``use_activation=False``), reduced by ``score_reduction`` / ``score_index`` as locally;
- a group judge (``reward_kind='group_judge'``): chat completions for a whole GRPO group (a
  :class:`~verl_async_rm.request.GroupRequest`), greedy, with ``response_format`` asking for the JSON schema of a
  number per label (OpenAI's structured outputs, which vLLM's server honours), read as locally
  (:mod:`~verl_async_rm.scoring.group_judge`).

A judge asked again (``judge_retries``) sees its previous reply as an assistant turn and a user turn saying why it did
not read (:func:`~.judge.judge_messages`): still greedy, so the same conversation gets the same answer.

The judge's user turn is rendered as the local judge renders it (:func:`~.judge.judge_text`); the server applies the
judge's chat template. With ``model_path`` (the checkpoint the server serves) an outcome RM sends the token ids the
local path builds, and a judge's input is counted by its tokenizer; without it an outcome RM sends the conversation
(the server renders it) and a request's tokens are estimated, then reconciled with the usage the server reports.
A missing judge token, an answer that does not read, a verdict that does not parse: an error for that trajectory,
never a score standing in."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import EndpointError, NonFiniteScoreError, RewardModelError
from verl_async_rm.request import GroupRequest, RMRequest, ScoreResult, Verdict
from verl_async_rm.scoring.group_judge import (GROUP_VARIABLES, group_text, group_verdict, long_group_error,
                                               member_labels, reply_form, reply_schema)
from verl_async_rm.scoring.inputs import conversation_for, strip_trailing
from verl_async_rm.scoring.judge import (VERDICT_CHARS, chat_ids, compile_pattern, compile_prompt, judge_messages,
                                         judge_text, parse_verdict, verdict_form)
from verl_async_rm.scoring.outcome import policy_side
from verl_async_rm.scoring.rm_config import RMConfig, kind_class

__all__ = ["Call", "RemoteKind", "remote_kind", "TOP_LOGPROBS"]

#: Log-probabilities asked for at the judge's first token: the most OpenAI's API and vLLM's default serve.
TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Call:
    """One request to the endpoint: its path (``at_root``: the server's root, not the base URL), its JSON, the tokens
    it sends (counted or estimated) and the most tokens it may get back."""

    path: str
    payload: dict[str, Any]
    tokens: int
    max_output_tokens: int
    at_root: bool = False


class RemoteKind:
    """The outcome RM at an endpoint (base of the judges): :meth:`call` builds the request of one trajectory,
    :meth:`read` turns the server's answer into its score or error."""

    def __init__(self, config: RMConfig, model: str) -> None:
        self.config, self.model = config, model
        self.policy_tokenizer, self.stop_ids, self.id_limit = policy_side(config)
        #: The local kind, when the served checkpoint is here too: it builds the input as the local path does.
        self.local: Any = None
        if config.model_path:
            from transformers import AutoConfig

            from verl_async_rm.scoring.checkpoint import load_tokenizer

            rm_tokenizer = load_tokenizer(config.model_path, "model_path", config.trust_remote_code)
            text_config = AutoConfig.from_pretrained(config.model_path).get_text_config()
            self.local = kind_class(config)(config, rm_tokenizer, text_config, int(text_config.vocab_size))

    def call(self, request: RMRequest) -> Call:
        payload: dict[str, Any] = {"model": self.model, "use_activation": False}
        if self.local is not None:
            ids = self.local.build(request).ids
            payload["input"], tokens = ids, len(ids)
        else:
            response = self.policy_tokenizer.decode(strip_trailing(request.response_ids, self.stop_ids),
                                                    skip_special_tokens=False)
            payload["messages"] = conversation_for(request, response)
            tokens = _estimate(str(payload["messages"]))
        return Call("/classify", payload, tokens, 0, at_root=True)

    def read(self, request: RMRequest, body: Any) -> ScoreResult:
        try:
            outputs = [float(v) for v in body["data"][0]["probs"]]
        except (KeyError, IndexError, TypeError, ValueError):
            return _unreadable(request, body, "data[0].probs, the classify endpoint's scores")
        config = self.config
        if config.score_reduction == "index":
            if not -len(outputs) <= config.score_index < len(outputs):
                return RewardModelError(f"trajectory {request.uid}: the server returned {len(outputs)} output(s), no "
                                        f"score_index={config.score_index}")
            value = outputs[config.score_index]
        else:
            value = {"mean": lambda v: math.fsum(v) / len(v), "sum": math.fsum, "max": max,
                     "min": min}[config.score_reduction](outputs)
        if not math.isfinite(value):
            return NonFiniteScoreError(f"trajectory {request.uid}: the RM at the endpoint returned {value}")
        return value

    def _chat(self, request: RMRequest, form: str = "") -> tuple[list[dict[str, str]], int]:
        """The judge's messages for ``request`` (with a re-ask's turns, saying the answer must take ``form``) and the
        tokens they hold (:meth:`_count`)."""
        text = judge_text(request, template=self.template, policy_tokenizer=self.policy_tokenizer,
                          response_stop_ids=self.stop_ids, id_limit=self.id_limit)
        messages = judge_messages(text, request.reask, form)
        return messages, self._count(messages)

    def _count(self, messages: list[dict[str, str]]) -> int:
        """Tokens of ``messages``: counted by the judge's tokenizer when ``model_path`` is given, else estimated."""
        if self.local is not None:
            return len(chat_ids(messages, self.local.rm_tokenizer))
        return _estimate("".join(m["content"] for m in messages))


class _GenerateJudge(RemoteKind):
    """A judge that writes its verdict (see the module doc)."""

    def __init__(self, config: RMConfig, model: str) -> None:
        super().__init__(config, model)
        self.template = compile_prompt(config.judge_prompt)
        self.pattern, self.labels = compile_pattern(config.judge_pattern), dict(config.judge_labels or ())

    def call(self, request: RMRequest) -> Call:
        messages, tokens = self._chat(request, verdict_form(self.pattern, self.labels))
        payload = {"model": self.model, "messages": messages, "max_tokens": self.config.judge_max_tokens,
                   "temperature": 0}
        return Call("/chat/completions", payload, tokens, self.config.judge_max_tokens)

    def read(self, request: RMRequest, body: Any) -> ScoreResult:
        try:
            text = body["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError(type(text))
        except (KeyError, IndexError, TypeError):
            return _unreadable(request, body, "choices[0].message.content, the judge's text")
        where = f"judge {self.model} at the endpoint: trajectory {request.uid}: "
        try:
            return Verdict(parse_verdict(text, self.pattern, self.labels, where), text[-VERDICT_CHARS:])
        except RewardModelError as err:
            return err


class _GroupJudge(RemoteKind):
    """A group judge (see the module doc): :meth:`call` and :meth:`read` take a whole group."""

    def __init__(self, config: RMConfig, model: str) -> None:
        super().__init__(config, model)
        self.template = compile_prompt(config.judge_prompt, GROUP_VARIABLES)

    def call(self, group: GroupRequest) -> Call:  # type: ignore[override]
        """The group's request; ``RewardInputError`` when, counted by the judge's tokenizer (``model_path``), it is
        longer than ``max_length - judge_max_tokens``."""
        config = self.config
        text, labels = group_text(group, template=self.template, policy_tokenizer=self.policy_tokenizer,
                                  response_stop_ids=self.stop_ids, id_limit=self.id_limit, seed=config.judge_seed)
        messages = judge_messages(text, group.reask, reply_form(len(labels)))
        tokens = self._count(messages)
        room = None if self.local is None else self.local.room
        if room is not None and tokens > room:
            raise long_group_error(group, tokens, self.local.max_length, config.judge_max_tokens)
        schema = {"name": "grades", "schema": reply_schema(len(labels)), "strict": True}
        payload = {"model": self.model, "messages": messages, "max_tokens": config.judge_max_tokens, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": schema}}
        return Call("/chat/completions", payload, tokens, config.judge_max_tokens)

    def read(self, group: GroupRequest, body: Any) -> ScoreResult:  # type: ignore[override]
        try:
            text = body["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError(type(text))
        except (KeyError, IndexError, TypeError):
            return _unreadable(group, body, "choices[0].message.content, the judge's reply")
        where = f"group judge {self.model} at the endpoint: {group.uid}: "
        return group_verdict(group, member_labels(group, self.config.judge_seed), text, self.config.judge_scale,
                             where)  # type: ignore[return-value]


class _LogitsJudge(RemoteKind):
    """A judge read at its first token (see the module doc)."""

    def __init__(self, config: RMConfig, model: str) -> None:
        super().__init__(config, model)
        self.template = compile_prompt(config.judge_prompt)
        self.tokens = tuple(config.judge_tokens or ())

    def call(self, request: RMRequest) -> Call:
        messages, tokens = self._chat(request)
        payload = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0, "logprobs": True,
                   "top_logprobs": TOP_LOGPROBS}
        return Call("/chat/completions", payload, tokens, 1)

    def read(self, request: RMRequest, body: Any) -> ScoreResult:
        try:
            top = {}
            for entry in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
                top.setdefault(entry["token"], []).append(float(entry["logprob"]))
        except (KeyError, IndexError, TypeError, ValueError):
            return _unreadable(request, body, "choices[0].logprobs.content[0].top_logprobs, the first token's "
                                              "log-probabilities")
        missing = [t for t in self.tokens if t not in top]
        twice = [t for t in self.tokens if len(top.get(t, ())) > 1]
        if missing or twice:
            return RewardModelError(
                f"trajectory {request.uid}: the judge's first-token log-probabilities "
                f"({sorted(top)[:TOP_LOGPROBS]}) " + (f"do not hold judge_tokens {missing}: their probability is "
                                                      "below the top ones returned" if missing else
                                                      f"hold {twice} twice (two tokens read alike)") +
                ". Fix: ask the judge to answer with one of judge_tokens (judge_prompt), or use judge_readout=generate")
        logprobs = [top[t][0] for t in self.tokens]
        if not all(math.isfinite(v) for v in logprobs):
            return NonFiniteScoreError(f"trajectory {request.uid}: the judge returned log-probabilities {logprobs}")
        peak = max(logprobs)
        weights = [math.exp(v - peak) for v in logprobs]
        return weights[0] / math.fsum(weights)


def remote_kind(config: RMConfig, model: str) -> RemoteKind:
    """The remote kind of ``config`` (an outcome RM or a judge at ``config.endpoint``), asking for ``model``."""
    if config.reward_kind == "group_judge":
        return _GroupJudge(config, model)
    if config.reward_kind == "judge":
        return (_GenerateJudge if config.judge_readout == "generate" else _LogitsJudge)(config, model)
    return RemoteKind(config, model)


def _estimate(text: str) -> int:
    """Tokens of ``text`` when no tokenizer is at hand: about one per three characters, rounded up (reconciled with
    the usage the server reports)."""
    return len(text) // 3 + 8


def _unreadable(request: RMRequest | GroupRequest, body: Any, what: str) -> EndpointError:
    shown = repr(body)
    name = request.uid if isinstance(request, GroupRequest) else f"trajectory {request.uid}"
    return EndpointError(f"{name}: the endpoint's answer has no {what}: "
                         f"{shown[:300]}{'...' if len(shown) > 300 else ''}")
