"""The endpoint engine: an RM's forwards or generations at an OpenAI-compatible endpoint, as raw values the kinds
read as they read the vLLM engine's (:mod:`verl_async_rm.scoring`):

- an outcome RM: vLLM's classify endpoint (``/classify``, at the server's root), the head's raw outputs
  (``use_activation=False``) reduced by ``score_reduction`` / ``score_index`` (:func:`~.readout.reduce_row`); the
  inputs of a batch go in one request when they are token ids (``model_path`` given: the kind builds them as locally;
  in as few requests as keep each under ``max_tpm``), one request per conversation otherwise (the server renders it);
- a judge read at its first token (``judge_readout='logits'``): chat completions of one token with the first token's
  log-probabilities (``top_logprobs``): the first judge token's probability among ``judge_tokens`` (a softmax over
  their log-probabilities equals one over their logits, as the local readout computes it);
- a judge that writes, a group judge: chat completions (a group judge's reply schema as ``response_format``), the
  reply as :class:`~verl_async_rm.scoring.engine.Generated` with why it stopped; the verdict is read from the reply's
  content, never from its reasoning.

Chat requests send ``max_completion_tokens``, ``judge_temperature`` (none when None) and ``judge_request_extra``; the
requests of a batch go out at once. Whatever a server answers, a row gets its raw value or its error as a value
(:class:`~verl_async_rm.errors.EndpointError` for an answer of the wrong shape or type), never an exception and never
a number made from something that is not one."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import Any

from verl_async_rm.errors import AsyncRMError, EndpointError, NonFiniteScoreError, RewardModelError
from verl_async_rm.remote.endpoints import EndpointClient, Reply
from verl_async_rm.scoring.engine import Generated
from verl_async_rm.scoring.outcome import RMInput
from verl_async_rm.scoring.readout import reduce_row
from verl_async_rm.scoring.rm_config import JUDGE_KINDS, RMConfig

__all__ = ["EndpointEngine", "TOP_LOGPROBS"]

#: Log-probabilities asked for at the judge's first token: the most OpenAI's API and vLLM's default serve.
TOP_LOGPROBS = 20


class EndpointEngine:
    """The RM ``model`` at ``client``'s endpoints, for the kind of ``config`` (see the module doc)."""

    name = "endpoint"

    def __init__(self, config: RMConfig, client: EndpointClient, model: str) -> None:
        self.config, self.client, self.model = config, client, model
        self.chat = config.reward_kind in JUDGE_KINDS
        self.logits = self.chat and config.judge_readout == "logits"
        self.max_output = config.judge_max_tokens if config.writes else 1 if self.chat else 0
        self._extra = json.loads(config.judge_request_extra) if config.judge_request_extra else {}

    async def score_all(self, inputs: Sequence[RMInput], deadline: float) -> list[Any]:
        """One raw value per input, or its error as a value; ``deadline``: on the running loop's clock."""
        if self.chat:
            return list(await asyncio.gather(*(self._chat(x, deadline) for x in inputs)))
        if inputs and all(x.ids is not None for x in inputs):
            parts = _within(inputs, self.config.max_tpm)
            answers = await asyncio.gather(*(self._classify([x.ids for x in part], sum(x.num_tokens for x in part),
                                                            deadline) for part in parts))
            return [value for answer in answers for value in answer]
        answers = await asyncio.gather(*(self._classify(x.messages, x.num_tokens, deadline) for x in inputs))
        return [answer[0] for answer in answers]

    async def _classify(self, what: Any, tokens: int, deadline: float) -> list[Any]:
        """``/classify`` of a batch of id lists (one value each) or of one conversation (a list of one value)."""
        rows = len(what) if self.config.model_path else 1
        payload = {"model": self.model, "use_activation": False,
                   **({"input": what} if self.config.model_path else {"messages": what})}
        reply = await self._post("/classify", payload, tokens, deadline, at_root=True)
        if isinstance(reply, Exception):
            return [reply] * rows
        data = _field(reply, "data")
        if not isinstance(data, list) or len(data) != rows:
            return [self._unreadable(reply, f"data, a list of {rows} result(s)")] * rows
        by_index = {d.get("index", i) if isinstance(d, dict) else i: d for i, d in enumerate(data)}
        return [self._outcome(reply, by_index.get(i)) for i in range(rows)]

    def _outcome(self, reply: Reply, row: Any) -> Any:
        values = row.get("probs") if isinstance(row, dict) else None
        if not isinstance(values, list) or not all(_is_number(v) for v in values):
            return self._unreadable(reply, "probs, a list of numbers (the classify endpoint's outputs)")
        try:
            return reduce_row([float(v) for v in values], self.config.score_reduction, self.config.score_index)
        except (OverflowError, ValueError) as err:
            return RewardModelError(f"the RM at the endpoint: {err}")

    async def _chat(self, x: RMInput, deadline: float) -> Any:
        config = self.config
        payload: dict[str, Any] = {"model": self.model, "messages": x.messages, "max_completion_tokens":
                                   self.max_output, **self._extra}
        if config.judge_temperature is not None:
            payload["temperature"] = config.judge_temperature
        if self.logits:
            payload.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        if x.schema is not None:
            payload["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "reply", "schema": x.schema, "strict": True}}
        reply = await self._post("/chat/completions", payload, x.num_tokens, deadline)
        if isinstance(reply, Exception):
            return reply
        choice = _first(_field(reply, "choices"))
        if self.logits:
            return self._first_token(reply, choice)
        message = choice.get("message") if isinstance(choice, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        tokens = reply.usage.completion_tokens if reply.usage else 0
        if not isinstance(finish, str):  # a server that does not say why it stopped: cut if it wrote all it could
            finish = "length" if tokens >= self.max_output else None
        if isinstance(content, str) or (content is None and finish == "length"):  # cut before it wrote any content
            return Generated(content or "", tokens, finish)
        return self._unreadable(reply, "choices[0].message.content, the judge's text")

    def _first_token(self, reply: Reply, choice: Any) -> Any:
        """The first judge token's probability among ``judge_tokens``, from the first token's top log-probabilities."""
        try:
            top: dict[str, list[float]] = {}
            for entry in choice["logprobs"]["content"][0]["top_logprobs"]:
                if not isinstance(entry["token"], str) or not _is_number(entry["logprob"]):
                    raise TypeError(entry)
                top.setdefault(entry["token"], []).append(float(entry["logprob"]))
        except (KeyError, IndexError, TypeError, OverflowError):
            return self._unreadable(reply, "choices[0].logprobs.content[0].top_logprobs, the first token's "
                                           "log-probabilities")
        tokens = self.config.judge_tokens or ()
        missing = [t for t in tokens if t not in top]
        twice = [t for t in tokens if len(top.get(t, ())) > 1]
        if missing or twice:
            return RewardModelError(
                f"the judge's first-token log-probabilities ({sorted(top)[:TOP_LOGPROBS]}) " +
                (f"do not hold judge_tokens {missing}: their probability is below the top ones returned" if missing
                 else f"hold {twice} twice (two tokens read alike)") + ". Fix: ask the judge to answer with one of "
                "judge_tokens (judge_prompt), or use judge_readout=generate")
        logprobs = [top[t][0] for t in tokens]
        if not all(math.isfinite(v) for v in logprobs):
            return NonFiniteScoreError(f"the judge returned log-probabilities {logprobs}")
        peak = max(logprobs)
        weights = [math.exp(v - peak) for v in logprobs]
        return weights[0] / math.fsum(weights)

    async def _post(self, path: str, payload: dict[str, Any], tokens: int, deadline: float,
                    at_root: bool = False) -> Reply | AsyncRMError:
        try:
            return await self.client.post(path, payload, tokens=tokens, max_output_tokens=self.max_output,
                                          deadline=deadline, at_root=at_root)
        except AsyncRMError as err:
            return err

    def _unreadable(self, reply: Reply, what: str) -> EndpointError:
        shown = self.client.scrub(repr(reply.body))
        return EndpointError(f"{reply.endpoint}: the answer has no {what}: {shown[:300]}"
                             f"{'...' if len(shown) > 300 else ''}", endpoint=reply.endpoint, status=200)


def _within(inputs: Sequence[RMInput], max_tokens: float | None) -> list[Sequence[RMInput]]:
    """``inputs`` in order, in as few runs as keep each run's tokens within ``max_tokens`` (one request may not
    reserve more than a minute's budget); an input over it alone, for the limiter to refuse."""
    if max_tokens is None:
        return [inputs]
    parts: list[list[RMInput]] = [[]]
    used = 0
    for x in inputs:
        if parts[-1] and used + x.num_tokens > max_tokens:
            parts.append([])
            used = 0
        parts[-1].append(x)
        used += x.num_tokens
    return parts


def _field(reply: Reply, name: str) -> Any:
    return reply.body.get(name) if isinstance(reply.body, dict) else None


def _first(items: Any) -> Any:
    return items[0] if isinstance(items, list) and items else None


def _is_number(value: Any) -> bool:
    """A JSON number: an int or a float, not a boolean (and not a string that spells one)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
