"""An HTTP client for one remote RM served at one or several OpenAI-compatible base URLs (``http://host:port/v1``):
each request resolves once, within its deadline, with a decoded JSON object or a typed error that names what failed
(:class:`EndpointError`, ``RequestTimeoutError``, :class:`EndpointClosedError`).

Answers: a body is read up to :data:`MAX_BODY_BYTES` decoded (the client inflates gzip and deflate itself, never past
the cap). A 2xx is the reply when its body is a JSON object other than an error object (an ``error`` with none of
``choices``, ``data``, ``results``); what the object holds is for the caller to read.

Retries: an attempt is retried when it got a 429, 408 or 5xx; a 2xx with a body over the cap, not JSON (whatever the
parser raises, ``RecursionError`` included), not a JSON object, or an error object; a connection refused, dropped or
cut short, or a body that does not inflate; or no complete answer within ``attempt_timeout_s``
(:data:`ATTEMPT_TIMEOUT_S` by default; httpx's read, write and pool timeouts, bounded by it, count the same). It is
retried on another endpoint where there is one, after exponential backoff with full jitter (up to ``backoff_s``
before the first retry, doubling to at most :data:`BACKOFF_CAP_S`), honouring ``Retry-After`` (seconds or an HTTP
date, at most ``max_retry_after_s``: the endpoint takes no request before then, or, when it is the last endpoint in
service, the request that got it waits that long and the others go on), until the deadline; a wait that would end
past it fails at once. Nothing else is retried: another 4xx, a redirect or a TLS certificate that fails the check
fails at once (:class:`EndpointError`, with the status and the server's message). A deadline miss is a
``RequestTimeoutError`` whose ``__cause__`` is the last failure (the one that made it retry, where the deadline then
cut an attempt short); every wait (rate limits, backoff, each HTTP attempt) ends by the deadline. The model lists
(:meth:`EndpointClient.models`, :meth:`EndpointClient.resolve_model`) are asked for through the same path.

Routing: the available endpoint with the fewest requests in flight (ties in turn), another one than the endpoint that
just failed when there is one. :data:`MAX_FAILURES` consecutive failures (the retried ones above but a 429 or 408: a
connection error, a 5xx, a bad body, an attempt past ``attempt_timeout_s``; any other answer from the server resets
the count) take an endpoint out for :data:`COOLDOWN_S`; when it is back, one more failure takes it out again. The last
endpoint in service is never taken out (a cool-down or a ``Retry-After`` there would stop every request), so one
endpoint is always in service.

Security: the API key is read from the environment variable named ``api_key_env`` and sent as ``Authorization:
Bearer`` only with requests to the configured base URLs. Redirects are not followed (a 3xx fails the request, naming
its target): the key never reaches another host, and a moved endpoint is fixed in the config rather than hidden.
Proxies and ``.netrc`` from the environment are ignored (``trust_env=False``). The key appears in no log, error, repr
or statistic: a server's message or header that echoes it is masked before any cut (:meth:`EndpointClient.scrub`,
for callers that build errors from a reply's body). HTTPS certificates are checked unless ``verify=False``."""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import functools
import ipaddress
import json
import logging
import math
import os
import random
import ssl
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from verl_async_rm.errors import (EndpointClosedError, EndpointError,
                                  RequestTimeoutError)
from verl_async_rm.endpoint_urls import check_endpoints
from verl_async_rm.step_counter import StepCounter
from verl_async_rm.remote.limits import USAGE_CAP, Limiter, Permit, RateLimits
from verl_async_rm.percentiles import Samples

__all__ = ["EndpointClient", "Reply", "Usage", "parse_retry_after", "MAX_FAILURES", "COOLDOWN_S",
           "BACKOFF_CAP_S", "ATTEMPT_TIMEOUT_S", "MAX_RETRY_AFTER_S", "MAX_BODY_BYTES"]

logger = logging.getLogger(__name__)

#: Consecutive failures that take an endpoint out: one can be a stale keep-alive connection or one bad answer; three in
#: a row, with no answer between, mean the server is down or restarting.
MAX_FAILURES = 3
#: How long an endpoint stays out: long enough that the others take its traffic instead of retries hammering it,
#: short enough that a restarted server (a vLLM restart takes tens of seconds) is used again within seconds of it.
COOLDOWN_S = 5.0
#: The longest backoff between two attempts of one request (full jitter: a uniform draw up to the doubled bound).
BACKOFF_CAP_S = 5.0
#: Connecting gets this long at most (less when the deadline is nearer): an unreachable host fails over quickly.
CONNECT_TIMEOUT_S = 10.0
#: The default bound on one attempt (``attempt_timeout_s``): a judge writing a long verdict on a loaded server takes
#: tens of seconds; an attempt past five minutes is on a wedged server, and the request is better retried elsewhere.
ATTEMPT_TIMEOUT_S = 300.0
#: The default longest ``Retry-After`` honoured (``max_retry_after_s``): providers ask for seconds; one that asks for a
#: day (86400) would take its endpoint out for that long.
MAX_RETRY_AFTER_S = 60.0
#: The most a body may hold, decoded (a judge's reply, logprobs included, is kilobytes): past it the server is broken
#: or hostile (a 200 kB gzip body can inflate to 200 MB), so the body is not read further and the attempt fails.
MAX_BODY_BYTES = 16 * 2**20
#: An error's body is read this far at most: its message is all that is kept of it.
_ERROR_BODY_BYTES = 64 * 2**10
#: Keys that hold a result (chat and completions: choices; /classify, /models, embeddings: data; rerank: results): a
#: 2xx body with an ``error`` and none of these is an error.
_RESULT_KEYS = ("choices", "data", "results")
#: What a body may be encoded with (sent as Accept-Encoding), and zlib's wbits for each: the client inflates it itself,
#: at most to the cap (httpx would inflate each network read whole: 64 KiB of gzip to up to 64 MiB).
_CODINGS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS | 32}
_RETRY_STATUS = frozenset({408, 429})
_STEP_KEYS = ("requests", "completed", "failed", "timed_out", "cancelled", "attempts", "retries", "status_429",
              "endpoint_errors", "client_errors", "cooldowns", "tokens_in", "tokens_out")


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds (fractions accepted) or an HTTP date (against
    wall time ``now``, default ``time.time()``); None when absent or unreadable; never negative."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass(frozen=True)
class Usage:
    """The tokens the server says it processed."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Reply:
    """A successful answer: ``body`` (the decoded JSON object), the base URL that gave it, the attempts it took, its
    latency from the call (waits included), the usage the server reported (None if none, or not counts) and each wait
    the client chose (backoff, Retry-After, cool-down; the rate limits' waits are the limiter's)."""

    body: Any
    endpoint: str
    attempts: int
    latency_s: float
    usage: Usage | None
    waits_s: tuple[float, ...] = ()


class _Secret:
    """The API key; its repr never shows it."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "<secret>"


@dataclass
class _Endpoint:
    url: str
    origin: tuple[str, str, int | None]
    outstanding: int = 0
    failures: int = 0  # consecutive
    out_until: float = -math.inf
    out_reason: str | None = None
    attempts: int = 0
    errors: int = 0
    usage_warned: bool = False  # a usage past the limiter's cap was reported


@dataclass
class _Failure:
    error: EndpointError
    retry: bool
    counts: bool  # towards the endpoint's consecutive failures
    retry_after: float | None = None
    deadline: bool = False  # the deadline passed during the attempt


class EndpointClient:
    """Requests to one remote RM at ``urls`` (see the module doc). ``limits``: job-wide :class:`RateLimits` (or a
    shared :class:`Limiter`); ``verify``: check HTTPS certificates (True), not (False), or a CA bundle path or an
    ``ssl.SSLContext``; ``max_failures``/``cooldown_s``: when an endpoint is taken out and for how long;
    ``backoff_s``: the most the first retry waits (full jitter, doubling per retry); ``attempt_timeout_s``: the
    longest one attempt may take (past it, an endpoint failure, retried); ``max_retry_after_s``: the longest
    ``Retry-After`` honoured (a longer one is read as this); ``rng``: the jitter's source. Binds to the event loop of
    its first request."""

    def __init__(self, urls: str | Sequence[str], *, api_key_env: str | None = None,
                 limits: RateLimits | Limiter | None = None, verify: bool | str | ssl.SSLContext = True,
                 max_failures: int = MAX_FAILURES, cooldown_s: float = COOLDOWN_S, backoff_s: float = 0.1,
                 attempt_timeout_s: float = ATTEMPT_TIMEOUT_S, max_retry_after_s: float = MAX_RETRY_AFTER_S,
                 rng: random.Random | None = None) -> None:
        self.urls = check_endpoints(urls)
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1:
            raise ValueError(f"max_failures={max_failures!r}: give an integer >= 1, e.g. {MAX_FAILURES}")
        for name, value in (("cooldown_s", cooldown_s), ("backoff_s", backoff_s), ("max_retry_after_s",
                                                                                     max_retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name}={value!r}: give a finite number of seconds >= 0")
        if isinstance(attempt_timeout_s, bool) or not isinstance(attempt_timeout_s, int | float) or \
                not 0 < attempt_timeout_s < math.inf:
            raise ValueError(f"attempt_timeout_s={attempt_timeout_s!r}: give a finite number of seconds > 0, e.g. "
                             f"{ATTEMPT_TIMEOUT_S:g}")
        self.api_key_env = api_key_env
        self._key = _Secret(_read_key(api_key_env)) if api_key_env is not None else None
        self.limiter = limits if isinstance(limits, Limiter) else Limiter(limits)
        self.max_failures, self.cooldown_s, self.backoff_s = max_failures, float(cooldown_s), float(backoff_s)
        self.attempt_timeout_s, self.max_retry_after_s = float(attempt_timeout_s), float(max_retry_after_s)
        self._rng = rng or random.Random()
        self._endpoints = []
        for url in self.urls:
            parsed = httpx.URL(url)
            self._endpoints.append(_Endpoint(url, (parsed.scheme, parsed.host, parsed.port)))
            if self._key is not None and parsed.scheme == "http" and not _is_loopback(parsed.host):
                logger.warning("endpoint %s is plain http: the API key from $%s travels unencrypted; use https",
                               url, api_key_env)
        if verify is True:
            verify = _default_tls()
        elif isinstance(verify, str):
            verify = ssl.create_default_context(**{"capath" if os.path.isdir(verify) else "cafile": verify})
        # The limiter bounds concurrency; the pool must not add a hidden second bound.
        pool = httpx.Limits(max_connections=None, max_keepalive_connections=self.limiter.limits.max_concurrency or 64)
        self._http = httpx.AsyncClient(verify=verify, follow_redirects=False, trust_env=False, limits=pool,
                                       timeout=httpx.Timeout(CONNECT_TIMEOUT_S))
        self._rr = 0
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._counts = StepCounter(_STEP_KEYS)
        self._latency = Samples()

    def __repr__(self) -> str:
        return (f"EndpointClient(urls={self.urls!r}, api_key_env={self.api_key_env!r}, "
                f"limits={self.limiter.limits!r})")

    def scrub(self, text: str) -> str:
        """``text`` with the API key masked (``***``) wherever it appears. Mask a text before cutting it: a cut
        through the key would leave a part of it that no mask finds."""
        return text.replace(self._key.value, "***") if self._key is not None else text

    async def post(self, path: str, payload: Mapping[str, Any], *, tokens: int, max_output_tokens: int = 0,
                   deadline: float, at_root: bool = False) -> Reply:
        """POST ``payload`` as JSON to ``path`` under the base URL (``/chat/completions``; from the host's root with
        ``at_root``: vLLM's ``/classify``). ``tokens``: what the request sends; with ``max_output_tokens`` it is the
        reservation under tokens/min (:class:`TokenLimitError` at once if it can never fit). ``deadline``: on the
        running loop's clock (``loop.time()``). Raises :class:`EndpointError`, ``RequestTimeoutError`` or
        :class:`EndpointClosedError`; a cancelled caller cancels its HTTP request."""
        for name, value in (("tokens", tokens), ("max_output_tokens", max_output_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(deadline, int | float) or not math.isfinite(deadline):
            raise ValueError(f"deadline must be a finite time on the loop's clock, got {deadline!r}")
        self._url(self._endpoints[0], path, at_root)  # a bad path fails here, not in the first attempt
        content = json.dumps(payload, separators=(",", ":")).encode()
        reply = await self._request("POST", path, content, tokens + max_output_tokens, deadline, at_root=at_root,
                                    tally=self._counts)
        self._latency.add(reply.latency_s)
        return reply

    async def models(self, timeout_s: float = 10.0) -> dict[str, list[str]]:
        """``GET /models`` on every endpoint at once, each through the retry path of :meth:`post` (its endpoint
        only; the rate limits apply) until ``timeout_s``: the model ids each lists. Not counted in the step stats
        (a start-up check). Raises :class:`EndpointError` naming every endpoint that failed and why (the last
        failure of one that ran out of time, a 4xx at once)."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s={timeout_s!r}: give a finite number of seconds > 0")
        deadline = self._bind().time() + timeout_s
        tally = StepCounter(_STEP_KEYS)  # a start-up check's own, not the step's

        async def one(ep: _Endpoint) -> list[str]:
            try:
                body = (await self._request("GET", "/models", None, 0, deadline, pin=ep, tally=tally)).body
            except RequestTimeoutError as err:
                raise EndpointError(f"{ep.url}: {err}", endpoint=ep.url) from err
            data = body.get("data")
            if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                     for m in data):
                raise EndpointError(f"{ep.url}: /models answered a JSON object with "
                                    f"{self.scrub(repr(sorted(map(str, body))))[:200]} and no model list",
                                    endpoint=ep.url)
            return [m["id"] for m in data]

        results = await asyncio.gather(*(one(ep) for ep in self._endpoints), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for r in failed:
            if not isinstance(r, EndpointError):
                raise r
        if failed:
            raise EndpointError(f"{len(failed)} of {len(results)} endpoint(s) failed the /models check: "
                                + "; ".join(str(e) for e in failed), endpoint=failed[0].endpoint)  # type: ignore
        return {ep.url: r for ep, r in zip(self._endpoints, results)}  # type: ignore[misc]

    async def resolve_model(self, wanted: str | None, *, timeout_s: float = 30.0) -> str:
        """The model to ask for: ``wanted`` (the RM's ``endpoint_model``), which every endpoint must list, or, when
        None, the one model the endpoints list (a server with LoRA modules, or a gateway, lists several: which one
        judges is for the user to say). Lists them with :meth:`models` (``timeout_s``). Raises ``ValueError`` naming
        the URL(s), what they list and the fix."""
        if wanted is not None and (not isinstance(wanted, str) or not wanted):
            raise ValueError(f"endpoint_model={wanted!r}: give the name of a model the endpoint serves, or None")
        try:
            served = await self.models(timeout_s)
        except EndpointError as err:
            raise ValueError(f"endpoint {list(self.urls)}: could not list its models ({err}). Fix: start the server, "
                             "check the URL (http(s)://host:port/v1), the network path and api_key_env") from err
        if wanted is not None:
            missing = [url for url, ids in served.items() if wanted not in ids]
            if missing:
                raise ValueError(f"endpoint {missing} does not serve model {wanted!r} (it lists {served}). Fix: set "
                                 "endpoint_model to one it serves, or start the server with that model (vLLM: "
                                 "--served-model-name)")
            return wanted
        listed = list(dict.fromkeys(m for ids in served.values() for m in ids))
        if len(listed) != 1 or any(ids != listed for ids in served.values()):
            raise ValueError(f"endpoint {list(served)} lists {served}: endpoint_model is not set, which is allowed "
                             "only when the endpoints list one model, the same. Fix: set endpoint_model to the model "
                             "to ask for, one that every endpoint lists")
        logger.info("endpoint %s: using model %r, the one it lists (endpoint_model is not set)", list(served),
                    listed[0])
        return listed[0]

    def stats(self) -> dict[str, Any]:
        """Counters since the start (requests and their outcomes, attempts, retries, 429s, endpoint errors, 4xx,
        cool-downs, tokens in/out from the usage reported), latency (ms), requests in flight, endpoints out now, each
        endpoint's state, and the limiter's stats."""
        now = self._now()
        return {**self._counts.totals(), "in_flight": len(self._tasks),
                "latency_ms": dataclasses.asdict(self._latency.summary()),
                "endpoints_out": sum(ep.out_until > now for ep in self._endpoints),
                "endpoints": {ep.url: {"outstanding": ep.outstanding, "attempts": ep.attempts, "errors": ep.errors,
                                       "consecutive_failures": ep.failures,
                                       "out_for_s": max(0.0, ep.out_until - now),
                                       "out_reason": ep.out_reason if ep.out_until > now else None}
                              for ep in self._endpoints},
                "limits": self.limiter.stats()}

    def pop_step_stats(self) -> dict[str, Any]:
        """The counters of :meth:`stats` since the previous call (or the start), the step's latency p50/p99 (ms, None
        without requests) and the endpoints out now; starts a new step."""
        latency = self._latency.pop_step()
        return {**self._counts.pop_step(), "latency_ms_p50": latency.p50,
                "latency_ms_p99": latency.p99, "endpoints_out": sum(ep.out_until > self._now() for ep in
                                                                    self._endpoints)}

    async def aclose(self) -> None:
        """Stop (idempotent): requests in flight fail with :class:`EndpointClosedError`, new ones are refused, and the
        connections are closed; nothing of this client runs afterwards."""
        self._closed = True
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:  # each ends at its next await (httpx closes the connection on cancellation): bounded regardless
            _, stuck = await asyncio.wait(tasks, timeout=10.0)
            if stuck:
                logger.error("endpoint client: %d request(s) ignored their cancellation at close", len(stuck))
        await self._http.aclose()

    async def __aenter__(self) -> EndpointClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------------------------------ internals

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("this EndpointClient is bound to another event loop; use one client per loop")
        return loop

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else -math.inf

    async def _request(self, method: str, path: str, content: bytes | None, reserve: int, deadline: float, *,
                       at_root: bool = False, pin: _Endpoint | None = None, tally: StepCounter) -> Reply:
        """One request through the retry path, in a task that :meth:`aclose` cancels; on ``pin`` alone when given.
        Its outcome is counted in ``tally`` (the step stats, or a start-up check's own)."""
        if self._closed:
            raise EndpointClosedError("the endpoint client is closed; it takes no new requests")
        loop = self._bind()
        t0 = loop.time()
        tally.add("requests", 1)
        try:
            self.limiter.check_tokens(reserve)
        except Exception:
            tally.add("failed", 1)
            raise
        task = loop.create_task(self._send(method, path, at_root, content, reserve, deadline, t0, pin, tally))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            try:
                await asyncio.wait({task})  # unlike `await task`, tells our caller's cancellation from aclose()'s
            except asyncio.CancelledError:
                task.cancel()
                tally.add("cancelled", 1)
                raise
            if task.cancelled():
                raise EndpointClosedError("the endpoint client was closed while the request was in flight")
            reply = task.result()
        except asyncio.CancelledError:
            raise
        except RequestTimeoutError:
            tally.add("timed_out", 1)
            raise
        except BaseException:
            tally.add("failed", 1)
            raise
        tally.add("completed", 1)
        return reply

    async def _send(self, method: str, path: str, at_root: bool, content: bytes | None, reserve: int,
                    deadline: float, t0: float, pin: _Endpoint | None, tally: StepCounter) -> Reply:
        loop = self._loop
        assert loop is not None
        attempts, waits, tried = 0, [], []
        last: EndpointError | None = None
        avoid: _Endpoint | None = None
        not_before = -math.inf  # a Retry-After for this request alone
        while True:
            now = loop.time()
            if now >= deadline:
                raise self._deadline_error(path, attempts, tried, last, "no time was left for another attempt")
            wait = max(0.0, not_before - now, pin.out_until - now if pin is not None else 0.0)
            if attempts:
                wait = max(wait, self._rng.uniform(0.0, min(BACKOFF_CAP_S, self.backoff_s * 2 ** (attempts - 1))))
            if wait > 0:
                if now + wait >= deadline:
                    raise self._deadline_error(path, attempts, tried, last, f"the next attempt could start only in "
                                               f"{wait:.3g} s (backoff, Retry-After or cool-down)")
                waits.append(wait)
                await asyncio.sleep(wait)
            try:
                permit = await self.limiter.acquire(reserve, deadline)
            except RequestTimeoutError as err:
                raise self._deadline_error(path, attempts, tried, last, str(err))  # noqa: B904 - cause: last error
            ep = pin if pin is not None else self._pick(loop.time(), avoid)
            attempts += 1
            tried.append(ep.url)
            result = await self._attempt(ep, method, path, at_root, content, deadline, permit, attempts, tally)
            if isinstance(result, Reply):
                return dataclasses.replace(result, attempts=attempts, latency_s=loop.time() - t0, waits_s=tuple(waits))
            if result.deadline:  # the cause: the error that made it retry (a 503, say), if one did
                raise self._deadline_error(path, attempts, tried, last or result.error,
                                           "the last attempt ran out of time")
            last, avoid = result.error, ep
            if result.retry_after is not None:  # the endpoint takes no request before then; the last one in service
                until = loop.time() + result.retry_after  # stays in, and this request alone waits
                if not self._take_out(ep, until, "retry-after"):
                    not_before = until
            if result.counts:
                self._count_failure(ep, tally)
            if not result.retry:
                raise result.error
            logger.debug("request to %s: attempt %d failed (%s); retrying", path, attempts, result.error)

    async def _attempt(self, ep: _Endpoint, method: str, path: str, at_root: bool, content: bytes | None,
                       deadline: float, permit: Permit, attempt: int, tally: StepCounter) -> Reply | _Failure:
        """One HTTP attempt on ``ep``, ended by the deadline at the latest: the reply, or why it failed; releases
        ``permit`` with the usage the server reported."""
        loop = self._loop
        assert loop is not None
        ep.outstanding += 1
        ep.attempts += 1
        tally.add("attempts", 1)
        if attempt > 1:
            tally.add("retries", 1)
        used: int | None = None  # tokens the server processed; None: not known, the reservation stands
        try:
            url = self._url(ep, path, at_root)
            left = max(deadline - loop.time(), 1e-3)  # the limiter granted at the deadline at the latest
            budget = min(left, self.attempt_timeout_s)
            try:  # httpx's timeouts bound each read; this bounds the whole attempt, the body's reading included
                status, headers, raw, whole = await asyncio.wait_for(self._exchange(method, url, content, budget),
                                                                     budget)
            except asyncio.TimeoutError:  # the attempt's own bound, or the deadline (httpx's timeouts are not these)
                if budget < left:  # a wedged endpoint: its failure, and the request goes on elsewhere
                    return _Failure(EndpointError(f"{ep.url}: no answer within attempt_timeout_s="
                                                  f"{self.attempt_timeout_s:g} s", endpoint=ep.url),
                                    retry=True, counts=True)
                return _Failure(EndpointError(f"{ep.url}: no answer before the deadline", endpoint=ep.url),
                                retry=False, counts=False, deadline=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                used = 0
                if _bad_certificate(err):  # retrying cannot help
                    return _Failure(EndpointError(
                        self.scrub(f"{ep.url}: the server's TLS certificate failed the check ({err}); give the CA "
                                   "bundle that signed it in SSL_CERT_FILE=<path>"), endpoint=ep.url),
                        retry=False, counts=False)
                return self._transport_failure(ep, err)
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError, httpx.DecodingError) as err:
                return self._transport_failure(ep, err)
            except httpx.HTTPError as err:  # a local protocol error, an unsupported scheme...: not the server's doing
                return _Failure(EndpointError(self.scrub(f"{ep.url}: {type(err).__name__}: {err}"),
                                              endpoint=ep.url), retry=False, counts=False)
            result = self._answer(ep, status, headers, raw, whole, tally)
            if status == 429:
                used = 0
            elif isinstance(result, Reply) and result.usage is not None:
                used = result.usage.total
            return result
        finally:
            ep.outstanding -= 1
            counted = permit.release(used)
            if used is not None and counted is not None and counted < used and not ep.usage_warned:
                ep.usage_warned = True
                logger.warning("endpoint %s reported a usage of %d tokens for a request that reserved %d; the rate "
                               "limits count at most %d times the reservation (warned once per endpoint)", ep.url,
                               used, permit.tokens, USAGE_CAP)

    async def _exchange(self, method: str, url: httpx.URL, content: bytes | None,
                        budget: float) -> tuple[int, httpx.Headers, bytes, bool]:
        """Send the request and read its answer: the status, the headers, the body (decoded) and whether it is whole
        (a body larger than its cap is cut there and the connection closed)."""
        timeout = httpx.Timeout(budget, connect=min(budget, CONNECT_TIMEOUT_S))
        async with self._http.stream(method, url, content=content, headers=self._headers(), timeout=timeout) as resp:
            cap = MAX_BODY_BYTES if 200 <= resp.status_code < 300 else _ERROR_BODY_BYTES
            raw, whole = await _read_capped(resp, cap)
            return resp.status_code, resp.headers, raw, whole

    def _answer(self, ep: _Endpoint, status: int, headers: httpx.Headers, raw: bytes, whole: bool,
                tally: StepCounter) -> Reply | _Failure:
        """What an answer means: a reply (a 2xx whose body is a JSON object with no error in it), or a failure."""
        if 200 <= status < 300:
            if not whole:
                return _Failure(EndpointError(f"{ep.url}: answered {status} with a body over {MAX_BODY_BYTES} bytes "
                                              "(decoded); not read further", endpoint=ep.url, status=status),
                                retry=True, counts=True)
            body = _json(raw)
            if not isinstance(body, dict):
                return _Failure(EndpointError(f"{ep.url}: answered {status} with a body that is not a JSON object: "
                                              f"{self._excerpt(raw, 200)!r}",
                                              endpoint=ep.url, status=status), retry=True, counts=True)
            if body.get("error") and not any(key in body for key in _RESULT_KEYS):  # an error object, as in a 5xx
                return _Failure(EndpointError(f"{ep.url}: answered {status} with an error and no result: "
                                              f"{self._message(raw, body)}", endpoint=ep.url, status=status),
                                retry=True, counts=True, retry_after=self._retry_after(headers))
            usage = _usage(body)
            ep.failures = 0
            if usage is not None:
                tally.add("tokens_in", usage.prompt_tokens)
                tally.add("tokens_out", usage.completion_tokens)
            return Reply(body, ep.url, 0, 0.0, usage)
        ep.failures = 0 if status < 500 else ep.failures
        error = EndpointError(f"{ep.url}: HTTP {status}: {self._message(raw, _json(raw))}", endpoint=ep.url,
                              status=status)
        retry_after = self._retry_after(headers)
        if status == 429:
            tally.add("status_429", 1)
            return _Failure(error, retry=True, counts=False, retry_after=retry_after)
        if status >= 500:
            return _Failure(error, retry=True, counts=True, retry_after=retry_after)
        tally.add("client_errors", 1)
        if 300 <= status < 400:
            location = self.scrub(headers.get("location", ""))[:500]
            error = EndpointError(f"{ep.url}: answered {status} redirecting to {location!r}; "
                                  "redirects are not followed (the API key goes to the configured hosts only): "
                                  "configure the final URL", endpoint=ep.url, status=status)
        return _Failure(error, retry=status in _RETRY_STATUS, counts=False)

    def _transport_failure(self, ep: _Endpoint, err: httpx.HTTPError) -> _Failure:
        return _Failure(EndpointError(self.scrub(f"{ep.url}: {type(err).__name__}: {err}"), endpoint=ep.url),
                        retry=True, counts=True)

    def _pick(self, now: float, avoid: _Endpoint | None) -> _Endpoint:
        """The available endpoint with the fewest requests in flight, ties in turn; not ``avoid`` if another is
        available (one always is: :meth:`_take_out`)."""
        n = len(self._endpoints)
        ready = [ep for ep in self._endpoints if ep.out_until <= now]
        if len(ready) > 1 and avoid in ready:
            ready.remove(avoid)
        best: int | None = None
        for i in range(n):
            index = (self._rr + i) % n
            ep = self._endpoints[index]
            if ep in ready and (best is None or ep.outstanding < self._endpoints[best].outstanding):
                best = index
        assert best is not None  # _take_out never takes the last endpoint in service out
        self._rr = (best + 1) % n
        return self._endpoints[best]

    def _take_out(self, ep: _Endpoint, until: float, reason: str) -> bool:
        """Take ``ep`` out of service until ``until`` unless it is the last endpoint in service; whether it is out."""
        now = self._now()
        if not any(e is not ep and e.out_until <= now for e in self._endpoints):
            return False
        if until > ep.out_until:
            ep.out_until, ep.out_reason = until, reason
        return True

    def _count_failure(self, ep: _Endpoint, tally: StepCounter) -> None:
        """A connection error, 5xx or bad body: counted, and the endpoint taken out after ``max_failures``."""
        ep.failures += 1
        ep.errors += 1
        tally.add("endpoint_errors", 1)
        now = self._now()
        # The failures of requests in flight while it is out neither extend nor renew its cool-down (back in, its next
        # failure takes it out again); the last endpoint in service stays in: backoff alone paces the retries then.
        if ep.failures >= self.max_failures and ep.out_until <= now and self._take_out(ep, now + self.cooldown_s,
                                                                                       "cool-down"):
            tally.add("cooldowns", 1)
            logger.warning("endpoint %s failed %d times in a row; out for %g s (%d of %d endpoints out)", ep.url,
                           ep.failures, self.cooldown_s, sum(e.out_until > now for e in self._endpoints),
                           len(self._endpoints))

    def _deadline_error(self, path: str, attempts: int, tried: list[str], last: EndpointError | None,
                        why: str) -> RequestTimeoutError:
        where = ", ".join(dict.fromkeys(tried)) or "no endpoint"
        err = RequestTimeoutError(self.scrub(
            f"request to {path} missed its deadline after {attempts} attempt(s) on {where}: {why}"
            + (f"; last error: {last}" if last is not None else "")))
        err.__cause__ = last
        return err

    def _url(self, ep: _Endpoint, path: str, at_root: bool) -> httpx.URL:
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"path must start with '/', e.g. '/chat/completions', got {path!r}")
        url = httpx.URL(ep.url if not at_root else f"{ep.origin[0]}://{httpx.URL(ep.url).netloc.decode()}")
        url = httpx.URL(str(url) + path)
        if (url.scheme, url.host, url.port) != ep.origin:  # the key goes to the configured hosts only
            raise ValueError(f"path {path!r} leaves the endpoint's host {ep.url}")
        return url

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json", "Accept-Encoding": "gzip, deflate"}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key.value}"
        return headers

    def _retry_after(self, headers: httpx.Headers) -> float | None:
        """The answer's ``Retry-After`` in seconds, at most ``max_retry_after_s``; None without one."""
        seconds = parse_retry_after(headers.get("retry-after"))
        return None if seconds is None else min(seconds, self.max_retry_after_s)

    def _message(self, raw: bytes, body: Any) -> str:
        """The server's message in an error body ``raw`` (decoded: ``body``): OpenAI's ``error.message``, vLLM's
        ``error``, FastAPI's ``detail``, else the body itself; cut to 500 characters."""
        error = body.get("error") if isinstance(body, dict) else None
        for message in ((error.get("message") if isinstance(error, dict) else error,
                         body.get("message"), body.get("detail")) if isinstance(body, dict) else ()):
            if isinstance(message, str) and message:
                return self.scrub(message)[:500]
        return self._excerpt(raw, 500)

    def _excerpt(self, raw: bytes, chars: int) -> str:
        """The first ``chars`` characters of ``raw`` as text, the key masked before the cut (a key the cut goes
        through would be found by no mask): only what the cut can reach is decoded."""
        longest = chars + (len(self._key.value) if self._key is not None else 0)
        return self.scrub(raw[:4 * longest].decode(errors="replace"))[:chars]  # 4: UTF-8's longest character


def _default_tls() -> ssl.SSLContext:
    """The default context: certificates and host names checked against the CA bundle ``SSL_CERT_FILE`` (or the
    directory ``SSL_CERT_DIR``) names, as Python's ``ssl`` and most HTTP clients read them, else certifi's CAs."""
    return _tls_context(os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None)


@functools.cache
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    """Built once per CA source: loading a CA bundle takes tens of milliseconds per client."""
    if cafile or capath:
        return ssl.create_default_context(cafile=cafile, capath=capath)
    return httpx.create_ssl_context(verify=True, trust_env=False)


def _read_key(env: str) -> str:
    if not isinstance(env, str) or not env:
        raise ValueError(f"api_key_env={env!r}: give the NAME of the environment variable that holds the key")
    value = os.environ.get(env, "").strip()
    if not value:
        raise ValueError(f"api_key_env={env!r}: the environment variable {env} is not set or empty; export the key "
                         f"as {env} in every process that calls the endpoint (or drop api_key_env when it needs none)")
    return value


def _bad_certificate(err: BaseException) -> bool:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _read_capped(resp: httpx.Response, cap: int) -> tuple[bytes, bool]:
    """The body of ``resp``, decoded, and whether it is whole: read and inflated chunk by chunk until it ends or holds
    more than ``cap`` bytes (then it is cut to :data:`_ERROR_BODY_BYTES` and the rest left unread). Raises
    ``httpx.DecodingError`` for a coding the client did not ask for or a corrupt compressed body."""
    coding = resp.headers.get("content-encoding", "identity").strip().lower()
    if coding not in _CODINGS and coding not in ("identity", ""):
        raise httpx.DecodingError(f"the body's Content-Encoding {coding!r} is none the client accepts (gzip, deflate)")
    decoder = zlib.decompressobj(_CODINGS[coding]) if coding in _CODINGS else None
    body = bytearray()
    try:
        async for chunk in resp.aiter_raw():
            while chunk and len(body) <= cap:
                if decoder is None:
                    body += chunk
                    break
                body += decoder.decompress(chunk, cap + 1 - len(body))  # never more than the cap allows
                chunk = decoder.unconsumed_tail
            if len(body) > cap:
                return bytes(body[:_ERROR_BODY_BYTES]), False
        if decoder is not None:
            body += decoder.flush()
    except zlib.error as err:
        raise httpx.DecodingError(f"the body does not inflate ({coding}): {err}") from None
    return (bytes(body), True) if len(body) <= cap else (bytes(body[:_ERROR_BODY_BYTES]), False)


def _json(raw: bytes) -> Any:
    """``raw`` decoded as JSON, or None when it does not decode (whatever json raises on it: bad syntax or encoding,
    nesting deeper than the interpreter's stack, an integer too long...)."""
    try:
        return json.loads(raw)
    except Exception:  # noqa: BLE001 - any failure to decode is a body that does not read
        return None


def _usage(body: dict) -> Usage | None:
    """The ``usage`` the body reports; None without one, or when a count in it is not an integer >= 0 (a float, a
    bool, a negative number: a server that gets one count wrong may get the other wrong too)."""
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    completion = 0 if completion is None else completion  # /classify and embeddings report none
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (prompt, completion)):
        return None
    return Usage(prompt, completion)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
