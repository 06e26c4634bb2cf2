"""``RemoteRMService``: an RM served elsewhere (``endpoint``), as a Ray actor with :class:`~.service.RMService`'s
calls, so the manager and the workers treat both alike. It places nothing: each trajectory is one request (or, for a
judge whose verdict does not parse, up to ``judge_retries`` more, each with the previous reply and why it did not
read) through one :class:`~..remote.endpoints.EndpointClient`, whose limits hold for the whole job since every
agent-loop worker calls this one actor. A group judge's trajectories wait in a :class:`~.group_gate.GroupGate` for
their group, which is one request."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any

from verl_async_rm.errors import AsyncRMError, EndpointError, JudgeVerdictError
from verl_async_rm.remote.endpoints import EndpointClient
from verl_async_rm.remote.kinds import RemoteKind, remote_kind
from verl_async_rm.remote.limits import RateLimits
from verl_async_rm.request import GroupRequest, RMRequest, ScoreResult
from verl_async_rm.scoring.rm_config import JUDGE_KINDS, RMConfig
from verl_async_rm.service.group_gate import GroupGate
from verl_async_rm.service.metrics import group_metrics, judge_cost

logger = logging.getLogger(__name__)

__all__ = ["RemoteRMService", "resolve_model", "probe", "REMOTE_FIGURES"]

#: The step figures of a remote RM (``async_rm/[<name>/]<figure>``), besides ``requests``, ``scored``, ``errors`` and
#: ``reward_tail_s``, which every RM reports.
REMOTE_FIGURES = ("endpoint_requests", "endpoint_retries", "endpoint_429s", "endpoint_errors",
                  "endpoint_latency_ms/p50", "endpoint_latency_ms/p99", "endpoint_tokens_in", "endpoint_tokens_out",
                  "endpoints_out")
#: Longest wait for the endpoints' model lists at the start.
_MODELS_S = 30.0
#: A request's deadline when the caller gives none.
_NO_DEADLINE_S = 3600.0


async def resolve_model(client: EndpointClient, config: RMConfig, timeout_s: float = _MODELS_S) -> str:
    """The model to ask for: ``endpoint_model``, or the first the first endpoint lists; ``ValueError`` naming the URL
    and the fix when an endpoint cannot be reached or does not serve it."""
    loop = asyncio.get_running_loop()
    end, wait = loop.time() + timeout_s, 0.5
    while True:  # a 429, a 5xx or a dropped connection may pass: asked again until timeout_s
        try:
            served = await client.models(max(1.0, end - loop.time()))
            break
        except EndpointError as err:
            if (err.status is not None and err.status != 429 and err.status < 500) or loop.time() + wait > end:
                raise ValueError(f"endpoint {list(config.endpoint or ())}: could not list its models ({err}). Fix: "
                                 "start the server, check the URL (http(s)://host:port/v1), the network path and "
                                 "api_key_env") from err
            await asyncio.sleep(wait)
            wait *= 2
    model = config.endpoint_model or next(iter(next(iter(served.values()), [])), None)
    missing = [url for url, ids in served.items() if model not in ids]
    if model is None or missing:
        raise ValueError(f"endpoint {missing or list(served)} does not serve model {model!r} (it lists "
                         f"{ {url: ids for url, ids in served.items()} }). Fix: set endpoint_model to one it serves, "
                         "or start the server with that model (vLLM: --served-model-name)")
    return model


async def probe(config: RMConfig, timeout_s: float = _MODELS_S) -> str:
    """The start-up check of a remote RM: every endpoint lists the model and answers one request of the API the kind
    uses (``/classify`` or chat completions); returns the model. ``ValueError`` naming the URL and the fix."""
    model = None
    for url in config.endpoint or ():
        async with EndpointClient([url], api_key_env=config.api_key_env) as client:
            model = await resolve_model(client, config, timeout_s)
            outcome = config.reward_kind not in JUDGE_KINDS
            path, payload = (("/classify", {"model": model, "input": "ping", "use_activation": False}) if outcome else
                             ("/chat/completions", {"model": model, "max_tokens": 1,
                                                    "messages": [{"role": "user", "content": "ping"}]}))
            try:
                await client.post(path, payload, tokens=8, max_output_tokens=1, at_root=outcome,
                                  deadline=asyncio.get_running_loop().time() + timeout_s)
            except AsyncRMError as err:
                what = ("vLLM's classification endpoint (/classify: serve a sequence-classification checkpoint; vLLM "
                        "picks its pooling runner)" if outcome else "chat completions (serve a causal LM)")
                raise ValueError(f"endpoint {url} serves model {model!r} but not {what}: {err}. Fix: point "
                                 "endpoint at a server of that API, or set reward_kind to the RM it serves") from err
    assert model is not None
    return model


class RemoteRMService:
    """One remote RM (see the module doc): ``score`` returns the trajectory's score or, as a value, the error that
    kept it from being scored; it raises only if this actor is lost. ``batching`` and ``replace_replicas`` are
    accepted for :func:`~.service.launch_rm_service` and not used (nothing is batched or replaced here)."""

    def __init__(self, rm: RMConfig, batching: Any = None, *, name: str, replace_replicas: bool = True) -> None:
        self._rm, self._name = rm, name
        self._client: EndpointClient | None = None
        self._kind: RemoteKind | None = None
        self._model: str | None = None
        self._gate = (GroupGate(self._judge_group, wait_s=rm.group_wait_s, retries=rm.judge_retries, name=name)
                      if rm.reward_kind == "group_judge" else None)
        self._step = self._new_step()
        self._totals = {"requests": 0, "scored": 0, "errors": 0}

    async def start(self) -> list[dict[str, Any]]:
        """Open the client, find the model, load what builds each request (tokenizers); returns :meth:`describe`."""
        if self._kind is None:
            rm = self._rm
            self._client = EndpointClient(rm.endpoint, api_key_env=rm.api_key_env,
                                          limits=RateLimits(rm.max_concurrency, rm.max_rpm, rm.max_tpm))
            self._model = await resolve_model(self._client, rm)
            self._kind = await asyncio.to_thread(remote_kind, rm, self._model)
            logger.info("RM service %s: %s (%s) at %s", self._name, self._model, rm.reward_kind, list(rm.endpoint))
        return await self.describe()

    async def score(self, request: RMRequest, deadline_s: float | None = None) -> ScoreResult:
        """The RM score of one trajectory, or the error that kept it from being scored (``RequestTimeoutError`` past
        ``deadline_s``, after the client's retries). A judge's reply that does not read is asked again up to
        ``judge_retries`` times with the reply and why it did not read (:attr:`RMRequest.reask`)."""
        if self._gate is not None:
            return await self._gate.submit(request, deadline_s)
        step = self._step
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (deadline_s if deadline_s is not None else _NO_DEADLINE_S)
        step["requests"] += 1
        step["last_submit"] = time.monotonic()
        retries = self._rm.judge_retries if self._rm.writes else 0
        for asked in range(retries + 1):
            result = await self._ask(request, deadline)
            if not (isinstance(result, JudgeVerdictError) and result.reply is not None and asked < retries):
                break
            step["judge_reasks"] += 1
            request = dataclasses.replace(request, reask=(result.reply, result.reason or "it does not read"))
        step["errors" if isinstance(result, BaseException) else "scored"] += 1
        step["last_result"] = time.monotonic()
        return result

    async def withdraw(self, group: str, group_size: int | None) -> None:
        """A trajectory of ``group`` will never be scored here (its agent loop failed, or scored itself): a group
        judge judges its siblings without waiting for it (:meth:`GroupGate.withdraw`); other RMs have nothing to
        do."""
        if self._gate is not None:
            self._gate.withdraw(group, group_size)

    async def _judge_group(self, group: GroupRequest, deadline_s: float | None) -> ScoreResult:
        """One judge call for a group (the gate's ``judge``)."""
        loop = asyncio.get_running_loop()
        return await self._ask(group, loop.time() + (deadline_s if deadline_s is not None else _NO_DEADLINE_S))

    async def _ask(self, request: RMRequest | GroupRequest, deadline: float) -> ScoreResult:
        """One request to the endpoint for ``request`` (a trajectory, or a group) and its result, as a value; a
        judge's call counted with the tokens it read and wrote."""
        step = self._step
        try:
            kind, client = self._require(), self._client
            call = kind.call(request)  # type: ignore[arg-type]
            reply = await client.post(call.path, call.payload, tokens=call.tokens,  # type: ignore[union-attr]
                                      max_output_tokens=call.max_output_tokens, deadline=deadline,
                                      at_root=call.at_root)
        except AsyncRMError as err:
            return err
        result = kind.read(request, reply.body)  # type: ignore[arg-type]
        if self._rm.writes:
            step["judge_calls"] += 1
            step["judge_tokens_in"] += reply.usage.prompt_tokens if reply.usage else call.tokens
            step["judge_tokens"] += reply.usage.completion_tokens if reply.usage else 0
            step["judge_parse_failures"] += isinstance(result, JudgeVerdictError)
        return result

    async def begin_step(self, step_size: int | None = None) -> None:
        """Start a step: its figures count from here (nothing waits to be batched)."""
        self._step = self._new_step()
        if self._gate is not None:
            self._gate.pop_step_stats()

    async def flush_after(self, n: int) -> None:
        """Nothing waits to be batched here: each trajectory's request goes at once."""

    async def end_step(self) -> dict[str, float]:
        """The step's figures: trajectories and errors, the reward tail, the endpoints' requests, retries, 429s,
        errors, latency, tokens and the endpoints out for a cool-down; then a new step starts."""
        step, self._step = self._step, self._new_step()
        submit, result = step.pop("last_submit"), step.pop("last_result")
        step["reward_tail_s"] = result - submit if submit is not None and result is not None else None
        if self._gate is not None:  # trajectories are counted by the gate; the service's own counts are groups'
            group = self._gate.pop_step_stats()
            step.update(group_metrics(group), judge_reasks=group.reasks)
        for key in self._totals:
            self._totals[key] += step[key]
        judge = judge_cost(step["requests"], step.pop("judge_calls"), step.pop("judge_tokens_in"),
                           step.pop("judge_tokens"))
        client = self._client.pop_step_stats() if self._client is not None else {}
        figures: dict[str, Any] = {
            **step, **(judge if self._rm.writes else {}),
            "endpoint_requests": client.get("attempts"), "endpoint_retries": client.get("retries"),
            "endpoint_429s": client.get("status_429"), "endpoint_errors": client.get("endpoint_errors"),
            "endpoint_latency_ms/p50": client.get("latency_ms_p50"),
            "endpoint_latency_ms/p99": client.get("latency_ms_p99"), "endpoint_tokens_in": client.get("tokens_in"),
            "endpoint_tokens_out": client.get("tokens_out"), "endpoints_out": client.get("endpoints_out")}
        if not self._rm.writes:
            for key in ("judge_parse_failures", "judge_reasks"):
                figures.pop(key)
        return {k: float(v) for k, v in figures.items() if v is not None and math.isfinite(float(v))}

    async def sleep(self) -> dict[str, float]:
        return {"bytes": 0.0, "seconds": 0.0}

    async def wake(self) -> dict[str, float]:
        return {"bytes": 0.0, "seconds": 0.0}

    async def stats(self) -> dict[str, Any]:
        """Trajectories answered since start, the client's counters (:meth:`EndpointClient.stats`) and a group judge's
        groups waiting (:meth:`GroupGate.stats`)."""
        return {**self._totals, **(self._client.stats() if self._client is not None else {}),
                **(self._gate.stats() if self._gate is not None else {})}

    async def describe(self) -> list[dict[str, Any]]:
        """What serves the RM: the endpoints, the model, the kind (the key is never shown)."""
        rm = self._rm
        return [{"endpoint": list(rm.endpoint or ()), "model": self._model, "reward_kind": rm.reward_kind,
                 "judge_readout": rm.judge_readout if rm.reward_kind in JUDGE_KINDS else None,
                 "loaded": self._kind is not None, "model_path": rm.model_path}]

    async def close(self, grace_s: float = 10.0) -> None:
        """Close the client: requests in flight fail with ``EndpointClosedError``, a group judge's waiting members with
        ``BatcherClosedError`` (its judge calls get ``grace_s``). Idempotent."""
        if self._gate is not None:
            await self._gate.aclose(grace_s=grace_s)
        client, self._client, self._kind = self._client, None, None
        if client is not None:
            await client.aclose()

    async def ping(self) -> bool:
        return True

    def _require(self) -> RemoteKind:
        if self._kind is None or self._client is None:
            raise AsyncRMError(f"RM service {self._name!r} is not started, or is closed")
        return self._kind

    @staticmethod
    def _new_step() -> dict[str, Any]:
        return {"requests": 0, "scored": 0, "errors": 0, "judge_calls": 0, "judge_tokens_in": 0, "judge_tokens": 0,
                "judge_parse_failures": 0, "judge_reasks": 0, "last_submit": None, "last_result": None}
