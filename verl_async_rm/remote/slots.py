"""The replicas of an RM at an endpoint (``endpoint``), for its RM service: :data:`SLOTS_PER_ENDPOINT` slots per base
URL (a judge's: :data:`CHAT_SLOTS_PER_ENDPOINT`), each taking one batch at a time from the service's batcher, over
one :class:`~.endpoints.EndpointClient` whose limits hold for the whole job (every agent-loop worker calls the one
service). A slot's batch is built and read by the
RM's kind and sent by the :class:`~.engine.EndpointEngine`, as a replica's batch is built, run on its local engine and
read; nothing is placed, nothing sleeps, nothing is replaced (a failed attempt is retried on another endpoint by the
client). :func:`probe` is the start-up check the entry points run before anything starts."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

from verl_async_rm.errors import AsyncRMError, RewardModelError
from verl_async_rm.remote.endpoints import EndpointClient
from verl_async_rm.remote.engine import EndpointEngine
from verl_async_rm.remote.limits import RateLimits
from verl_async_rm.request import ScoreResult
from verl_async_rm.scoring.batch import KindBatch, ScorerStats, stat_names
from verl_async_rm.scoring.markup import neutralize_markup, special_token_strings
from verl_async_rm.scoring.outcome import Kind
from verl_async_rm.scoring.rm_config import JUDGE_KINDS, RMConfig, kind_class
from verl_async_rm.step_counter import StepCounter

__all__ = ["EndpointSlots", "probe", "SLOTS_PER_ENDPOINT", "CHAT_SLOTS_PER_ENDPOINT", "REMOTE_METRICS",
           "NO_DEADLINE_S"]

#: Batches in flight at once per base URL: enough that a server always has the next batch while it answers one
#: (vLLM batches the requests it holds), few enough that a backlog forms batches instead of single requests.
SLOTS_PER_ENDPOINT = 8
#: A judge's requests in flight at once per base URL (one per slot): enough that the job-wide limits
#: (``max_concurrency``) bound them, not the slots.
CHAT_SLOTS_PER_ENDPOINT = 256
#: Longest wait for the endpoints' model lists, and for the start-up check's one request.
_START_S = 30.0
#: A request sent with no deadline (the agent-loop workers always give ``request_timeout_s``) is retried this long.
NO_DEADLINE_S = 3600.0
#: A remote RM's step metrics from its endpoint client (``async_rm/[<name>/]<metric>``): that name, and the client's.
REMOTE_METRICS = {"endpoint_requests": "attempts", "endpoint_retries": "retries", "endpoint_429s": "status_429",
                  "endpoint_errors": "endpoint_errors", "endpoint_latency_ms/p50": "latency_ms_p50",
                  "endpoint_latency_ms/p99": "latency_ms_p99", "endpoint_tokens_in": "tokens_in",
                  "endpoint_tokens_out": "tokens_out", "endpoints_out": "endpoints_out"}


class EndpointSlots:
    """The slots of one remote RM (see the module doc): :meth:`score` is the batcher's ``batch_fn``."""

    sleeps = False  #: an endpoint is never put to sleep
    replace = None  #: nor replaced

    def __init__(self, rm: RMConfig, name: str) -> None:
        self.rm, self.name = rm, name
        self._chat = rm.reward_kind in JUDGE_KINDS
        per_url = CHAT_SLOTS_PER_ENDPOINT if self._chat else SLOTS_PER_ENDPOINT
        self.handles: list[Any] = list(range(per_url * len(rm.endpoint or ())))
        self._counts = StepCounter(stat_names(rm))
        self._client: EndpointClient | None = None
        self._kind: Kind | None = None
        self._engine: EndpointEngine | None = None

    def batching(self, policy: Any) -> Any:
        """How the batcher feeds the slots (``policy``: the service's ``BatchPolicy``): no ``batch_timeout_s`` (a slot's
        call waits at the job-wide limits and retries; each attempt is bounded by ``attempt_timeout_s``, each request
        by its deadline); a judge's items one per slot (each is its own request: in a batch the fast replies would
        wait for the slowest)."""
        return dataclasses.replace(policy, batch_timeout_s=None, **({"max_batch_size": 1} if self._chat else {}))

    async def start(self) -> None:
        """Open the client, find the model, load what builds each input (the tokenizers)."""
        rm = self.rm
        self._client = client(rm)
        try:
            model = await self._client.resolve_model(rm.endpoint_model, timeout_s=_START_S)
            self._kind = await asyncio.to_thread(_load_kind, rm)
        except BaseException:
            await self.close(self.handles, _START_S)
            raise
        self._engine = EndpointEngine(rm, self._client, model)

    async def score(self, items: Sequence[Any], slot: Any, deadline: float) -> list[ScoreResult]:
        """One result per item (a trajectory, or a group for a group judge): its score or its error, as a value; a
        batch with no deadline (``math.inf``: a caller gave none) is bounded by :data:`NO_DEADLINE_S`. Raises, for
        the whole batch, only a typed error: any other as :class:`RewardModelError` (its cause kept), as a replica's
        call does."""
        if self._engine is None:
            raise AsyncRMError(f"RM service {self.name!r}: the endpoint client is not started, or is closed")
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            batch = KindBatch(self._kind, items)
            raws = await self._engine.score_all(batch.inputs, min(deadline, start + NO_DEADLINE_S))
            results, counts = batch.read(raws)
        except AsyncRMError:
            raise
        except Exception as err:
            raise RewardModelError(f"RM service {self.name!r}: a batch of {len(items)} failed at the endpoint: "
                                   f"{err!r}") from err
        self._counts.add_all({**counts, "busy_s": loop.time() - start})
        return results

    async def step_stats(self, handles: Sequence[Any], timeout_s: float) -> list[ScorerStats]:
        """The step's counters of every slot together (since the last call)."""
        return [ScorerStats(**self._counts.pop_step())]

    def step_metrics(self) -> dict[str, float]:
        """The endpoint client's step stats (:data:`REMOTE_METRICS`), since the last call."""
        step = self._client.pop_step_stats() if self._client is not None else {}
        return {name: step[key] for name, key in REMOTE_METRICS.items() if step.get(key) is not None}

    def stats(self) -> dict[str, Any]:
        """``{"endpoint": the endpoint client's counters since the start}`` (:meth:`EndpointClient.stats`: HTTP
        requests, beside the batcher's trajectories)."""
        return {"endpoint": self._client.stats()} if self._client is not None else {}

    async def describe(self, handles: Sequence[Any], timeout_s: float) -> list[dict[str, Any]]:
        """What serves the RM: the endpoints, the model, the kind (the key is never shown)."""
        rm = self.rm
        return [{"endpoint": list(rm.endpoint or ()), "model": None if self._engine is None else self._engine.model,
                 "reward_kind": rm.reward_kind, "slots": len(self.handles), "loaded": self._engine is not None,
                 "judge_readout": rm.judge_readout if rm.reward_kind in JUDGE_KINDS else None,
                 "model_path": rm.model_path}]

    async def close(self, handles: Sequence[Any], timeout_s: float) -> None:
        """Close the client: requests in flight fail with ``EndpointClosedError``. Idempotent."""
        client_, self._client, self._engine = self._client, None, None
        if client_ is not None:
            await client_.aclose()


def client(rm: RMConfig) -> EndpointClient:
    """The endpoint client of ``rm``, with its job-wide limits."""
    return EndpointClient(rm.endpoint, api_key_env=rm.api_key_env,
                          limits=RateLimits(rm.max_concurrency, rm.max_rpm, rm.max_tpm),
                          attempt_timeout_s=rm.attempt_timeout_s, max_retry_after_s=rm.max_retry_after_s)


def _load_kind(rm: RMConfig) -> Kind:
    """The RM's kind, reading the served checkpoint's tokenizer and config when it is here (``model_path``). The
    server tokenizes what it gets, special tokens included: every value's markers are broken before it is sent (the
    tokenizer's own, else the common chat formats')."""
    tokenizer = kind = None
    if not rm.model_path:
        kind = kind_class(rm)(rm, None, None, None)
    else:
        from transformers import AutoConfig

        from verl_async_rm.scoring.checkpoint import load_tokenizer

        tokenizer = load_tokenizer(rm.model_path, "model_path", rm.trust_remote_code)
        text = AutoConfig.from_pretrained(rm.model_path, trust_remote_code=rm.trust_remote_code).get_text_config()
        kind = kind_class(rm)(rm, tokenizer, text, int(text.vocab_size))
    markers = special_token_strings(tokenizer) if tokenizer is not None else ()
    kind.escape = functools.partial(neutralize_markup, special_tokens=markers or None)
    return kind


async def probe(rm: RMConfig, timeout_s: float = _START_S) -> str:
    """The start-up check of a remote RM: every endpoint lists the model and answers one request of the API the kind
    uses (``/classify`` or chat completions); returns the model. ``ValueError`` naming the URL and the fix."""
    model = ""
    outcome = rm.reward_kind not in JUDGE_KINDS
    for url in rm.endpoint or ():
        async with EndpointClient([url], api_key_env=rm.api_key_env, attempt_timeout_s=rm.attempt_timeout_s,
                                  max_retry_after_s=rm.max_retry_after_s) as one:
            model = await one.resolve_model(rm.endpoint_model, timeout_s=timeout_s)
            extra = json.loads(rm.judge_request_extra) if rm.judge_request_extra else {}
            path, payload = (("/classify", {"model": model, "input": "ping", "use_activation": False}) if outcome else
                             ("/chat/completions", {"model": model, "max_completion_tokens": 1, **extra,
                                                    "messages": [{"role": "user", "content": "ping"}]}))
            try:
                await one.post(path, payload, tokens=8, max_output_tokens=1, at_root=outcome,
                               deadline=asyncio.get_running_loop().time() + timeout_s)
            except AsyncRMError as err:
                what = ("vLLM's classification endpoint (/classify: serve a sequence-classification checkpoint; vLLM "
                        "picks its pooling runner)" if outcome else "chat completions (serve a causal LM)")
                raise ValueError(f"endpoint {url} serves model {model!r} but not {what}: {err}. Fix: point "
                                 "endpoint at a server of that API, or set reward_kind to the RM it serves") from err
    return model
