"""Real HTTP servers for tests of remote RMs, on 127.0.0.1 only (aiohttp, each in a background thread with its own
event loop; start and stop them from sync fixtures):

- :class:`ScriptedUpstream`: OpenAI-shaped answers with no model, from functions the test gives: ``GET /v1/models``,
  ``POST /v1/chat/completions`` (with ``logprobs``/``top_logprobs`` when asked) and vLLM's ``POST /classify``;
- :class:`FaultProxy`: forwards to an upstream base URL and, on a deterministic seeded :class:`FaultSchedule` (per
  request index), answers 429 with ``Retry-After``, 500/503, drops the connection, answers after a delay, cuts the
  body, or answers 200 with a body that is not JSON, one nested too deep to parse, an error object, or a small gzip
  body that inflates past the client's cap; it counts what it injected and what it forwarded.

Both record every request (:attr:`TestServer.seen`), can hold requests at a gate until the test opens it
(event-gated tests: :meth:`TestServer.wait_until` instead of sleeps), and bound their load: past ``max_requests`` they
answer 410, and ``timeout_s`` after start they shut down by themselves."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import ssl
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

__all__ = ["FAULTS", "Fault", "FaultSchedule", "Completion", "Raw", "Seen", "TestServer", "ScriptedUpstream",
           "FaultProxy", "gzip_bomb"]

logger = logging.getLogger(__name__)

#: What the proxy can inject: ``rate_limit`` (429 + Retry-After), ``server_error`` (500), ``unavailable`` (503 +
#: Retry-After), ``drop`` (connection closed with no answer), ``delay`` (forwarded after ``delay_s``), ``truncate`` (the
#: body cut short and the connection closed), ``bad_json`` (a complete 200 whose body is not JSON), ``deep_json`` (a 200
#: whose JSON nests deeper than a parser's stack), ``error_200`` (a 200 carrying an OpenAI error object and no result),
#: ``gzip_bomb`` (a 200 whose 32 kB gzip body inflates to a 32 MiB JSON object, twice the client's cap).
FAULTS = ("rate_limit", "server_error", "unavailable", "drop", "delay", "truncate", "bad_json", "deep_json",
          "error_200", "gzip_bomb")
#: What a ``gzip_bomb`` fault inflates to, in MiB.
_BOMB_MIB = 32
#: Hop-by-hop and per-connection headers a proxy must not forward.
_INDEX, _BODY = web.RequestKey("index", int), web.RequestKey("body", object)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length",
                "proxy-authorization", "proxy-authenticate"}


@dataclass(frozen=True)
class Fault:
    """One injected fault; ``retry_after``: the ``Retry-After`` header of a 429/503 (None: no header)."""

    kind: str
    retry_after: str | None = "0"
    delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"fault kind {self.kind!r}: use one of {FAULTS}")


class FaultSchedule:
    """Which fault the request of each index (0, 1, ... in arrival order) gets: ``plan`` first (a mapping from
    index to fault, or a sequence whose entry i is request i's fault or None), then, for the other indices, a fault
    of ``kinds`` with probability ``rate``, drawn from ``seed`` and the index alone (the same whatever the timing)."""

    def __init__(self, plan: Mapping[int, Fault | str | None] | Sequence[Fault | str | None] = (), *,
                 rate: float = 0.0, kinds: Sequence[str] = FAULTS, seed: int = 0, retry_after: str | None = "0",
                 delay_s: float = 30.0) -> None:
        items = plan.items() if isinstance(plan, Mapping) else enumerate(plan)
        self.plan = {int(i): self._fault(f, retry_after, delay_s) for i, f in items}
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate={rate!r}: give a probability in [0, 1]")
        self.kinds = tuple(Fault(k).kind for k in kinds)
        self.rate, self.seed, self.retry_after, self.delay_s = rate, seed, retry_after, delay_s

    def fault(self, index: int) -> Fault | None:
        if index in self.plan:
            return self.plan[index]
        rng = random.Random(f"{self.seed}:{index}")
        if self.rate and rng.random() < self.rate:
            return Fault(rng.choice(self.kinds), self.retry_after, self.delay_s)
        return None

    @staticmethod
    def _fault(fault: Fault | str | None, retry_after: str | None, delay_s: float) -> Fault | None:
        return Fault(fault, retry_after, delay_s) if isinstance(fault, str) else fault


@dataclass(frozen=True)
class Completion:
    """A scripted chat answer: ``text``; ``top_logprobs``: per generated token, the candidates (token -> logprob,
    the chosen token first); token counts for ``usage`` (default: words of the prompt, tokens of the answer); why it
    stopped (``"length"``: cut at its token limit)."""

    text: str
    top_logprobs: Sequence[Mapping[str, float]] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Raw:
    """Any answer: a status, a body (JSON-encoded unless ``str``/``bytes``) and headers."""

    status: int
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Seen:
    """A request the server received: its index, method, path, headers (lower-case names), JSON body (None if not
    JSON) and the fault injected (proxy; None: forwarded as is)."""

    index: int
    method: str
    path: str
    headers: Mapping[str, str]
    body: Any
    fault: str | None = None


class TestServer:
    """An aiohttp application on 127.0.0.1 in a thread of its own; :meth:`start` binds port ``port`` (0: any free
    one, see :attr:`port`), :meth:`stop` ends it (idempotent; also when used as a context manager). With ``tls`` (a
    server ``ssl.SSLContext``) it speaks HTTPS."""

    __test__ = False  # not a pytest test class

    def __init__(self, *, port: int = 0, max_requests: int = 10_000, timeout_s: float = 120.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.port, self.max_requests, self.timeout_s, self.tls = port, max_requests, timeout_s, tls
        self.seen: list[Seen] = []
        self._cond = threading.Condition()
        self._held = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._gate: asyncio.Event | None = None
        self._handlers: set[asyncio.Task] = set()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -------------------------------------------------------------------------------------------- test-side API

    @property
    def origin(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI-style base URL (``http://127.0.0.1:PORT/v1``)."""
        return f"{self.origin}/v1"

    @property
    def held(self) -> int:
        """Requests waiting at the closed gate now."""
        with self._cond:
            return self._held

    def start(self, wait_s: float = 30.0) -> TestServer:
        self._thread = threading.Thread(target=self._serve, name=f"{type(self).__name__}-{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(wait_s):
            raise TimeoutError(f"{type(self).__name__} did not start within {wait_s} s")
        if self._error is not None:
            raise RuntimeError(f"{type(self).__name__} failed to start: {self._error!r}") from self._error
        return self

    def stop(self, wait_s: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self._shutdown()))
        thread.join(wait_s)
        if thread.is_alive():
            logger.error("%s on port %d did not stop within %g s", type(self).__name__, self.port, wait_s)

    def close_gate(self) -> None:
        """Hold every request that arrives from now on (before it is answered or forwarded) until :meth:`open_gate`."""
        self._call(lambda: self._gate.clear())  # type: ignore[union-attr]

    def open_gate(self) -> None:
        self._call(lambda: self._gate.set())  # type: ignore[union-attr]

    async def wait_until(self, predicate: Callable[[TestServer], bool], timeout_s: float = 10.0) -> None:
        """Return once ``predicate(self)`` holds (checked whenever a request arrives, is held or ends); raises
        ``TimeoutError`` after ``timeout_s``."""
        if not await asyncio.to_thread(self._wait_sync, predicate, timeout_s):
            raise TimeoutError(f"{type(self).__name__}: condition not met within {timeout_s} s (seen "
                               f"{len(self.seen)}, held {self.held})")

    def __enter__(self) -> TestServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------------------- server side

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._setup())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.call_later(self.timeout_s, self._expire)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _setup(self) -> None:
        self._gate = asyncio.Event()
        self._gate.set()
        app = web.Application(middlewares=[self._middleware])
        self.routes(app)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.tls)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _expire(self) -> None:
        logger.error("%s on port %d: timeout_s=%g passed; shutting down", type(self).__name__, self.port,
                     self.timeout_s)
        self._loop.create_task(self._shutdown())  # type: ignore[union-attr]

    async def _shutdown(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        self._loop.stop()  # type: ignore[union-attr]

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        task = asyncio.current_task()
        self._handlers.add(task)  # type: ignore[arg-type]
        try:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            with self._cond:
                index = len(self.seen)
                request[_INDEX], request[_BODY] = index, body
                self.seen.append(Seen(index, request.method, request.path_qs,
                                      {k.lower(): v for k, v in request.headers.items()}, body))
                self._cond.notify_all()
            if index >= self.max_requests:
                return web.json_response({"error": {"message": f"test server: max_requests={self.max_requests} "
                                                               "reached"}}, status=410)
            if not self._gate.is_set():  # type: ignore[union-attr]
                with self._cond:
                    self._held += 1
                    self._cond.notify_all()
                try:
                    await self._gate.wait()  # type: ignore[union-attr]
                finally:
                    with self._cond:
                        self._held -= 1
                        self._cond.notify_all()
            return await handler(request)
        finally:
            self._handlers.discard(task)  # type: ignore[arg-type]
            with self._cond:
                self._cond.notify_all()

    def _record_fault(self, index: int, fault: str) -> None:
        with self._cond:
            old = self.seen[index]
            self.seen[index] = Seen(old.index, old.method, old.path, old.headers, old.body, fault)

    def _call(self, fn: Callable[[], Any]) -> None:
        if self._loop is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        self._loop.call_soon_threadsafe(fn)

    def _wait_sync(self, predicate: Callable[[TestServer], bool], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


class ScriptedUpstream(TestServer):
    """An OpenAI-compatible server with no model. ``chat(payload)`` answers ``/v1/chat/completions`` (a ``str``, a
    :class:`Completion` or a :class:`Raw`; default: the last message's content echoed); ``classify(item)`` gives the
    class probabilities of one ``input`` item of ``/classify`` (default ``[0.5]``); ``models``: what ``/v1/models``
    lists (the first one is the ``model`` of answers to requests that name none); ``list_models()``, when given,
    answers ``/v1/models`` instead when it returns a :class:`Raw` (None: the list); ``latency_s``: how long each chat
    or classify answer waits before it is sent (an asyncio sleep: the server takes other requests meanwhile)."""

    def __init__(self, chat: Callable[[dict], str | Completion | Raw] | None = None,
                 classify: Callable[[Any], Sequence[float] | Raw] | None = None, *, models: Sequence[str] = ("judge",),
                 list_models: Callable[[], Raw | None] | None = None, latency_s: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= latency_s < float("inf"):
            raise ValueError(f"latency_s={latency_s!r}: give a finite number of seconds >= 0")
        self.chat = chat or (lambda payload: str(payload["messages"][-1]["content"]))
        self.classify = classify or (lambda item: [0.5])
        self.models = tuple(models)
        self.list_models = list_models
        self.latency_s = float(latency_s)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/classify", self._classify)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        answer = self.list_models() if self.list_models is not None else None
        if answer is not None:
            return _raw(answer)
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "test", "root": m} for m in self.models]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        payload = request[_BODY]
        if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
            return _error(400, "the body must be a JSON object with 'messages'")
        await asyncio.sleep(self.latency_s)
        answer = self.chat(payload)
        if isinstance(answer, Raw):
            return _raw(answer)
        if isinstance(answer, str):
            answer = Completion(answer)
        tokens = answer.text.split() or [""]
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": answer.text},
                                  "logprobs": None, "finish_reason": answer.finish_reason}
        if payload.get("logprobs"):
            k = int(payload.get("top_logprobs") or 0)
            steps = answer.top_logprobs or [{t: 0.0} for t in tokens]
            choice["logprobs"] = {"content": [_logprob_entry(step, k) for step in steps]}
        prompt = answer.prompt_tokens
        if prompt is None:
            prompt = sum(len(str(m.get("content", "")).split()) for m in payload["messages"])
        completion = answer.completion_tokens
        if completion is None:
            completion = len(answer.top_logprobs) if answer.top_logprobs else len(tokens)
        return web.json_response({
            "id": f"chatcmpl-{request[_INDEX]}", "object": "chat.completion", "created": int(time.time()),
            "model": payload.get("model", self.models[0]), "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})

    async def _classify(self, request: web.Request) -> web.StreamResponse:
        payload = request[_BODY]
        if not isinstance(payload, dict) or ("input" not in payload and "messages" not in payload):
            return _error(400, "the body must be a JSON object with 'input' or 'messages'")
        await asyncio.sleep(self.latency_s)
        raw_items = payload["input"] if "input" in payload else [json.dumps(payload["messages"])]
        one = isinstance(raw_items, str) or (isinstance(raw_items, list) and raw_items and
                                             isinstance(raw_items[0], int))
        items = [raw_items] if one else list(raw_items)
        data, tokens = [], 0
        for i, item in enumerate(items):
            probs = self.classify(item)
            if isinstance(probs, Raw):
                return _raw(probs)
            probs = [float(p) for p in probs]
            tokens += len(item) if isinstance(item, list) else len(str(item).split())
            data.append({"index": i, "label": f"LABEL_{max(range(len(probs)), key=probs.__getitem__)}",
                         "probs": probs, "num_classes": len(probs)})
        return web.json_response({
            "id": f"classify-{request[_INDEX]}", "object": "list", "created": int(time.time()),
            "model": payload.get("model", self.models[0]), "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}})


class FaultProxy(TestServer):
    """Forwards every request to ``upstream`` (a base URL; the request's path is kept) except those its
    ``schedule`` picks, which get their fault. :attr:`injected` counts faults by kind, :attr:`forwarded` the requests
    passed on."""

    def __init__(self, upstream: str, schedule: FaultSchedule | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.upstream = upstream.rstrip("/")
        self.schedule = schedule or FaultSchedule()
        self.injected: Counter[str] = Counter()
        self.forwarded = 0
        self._session: ClientSession | None = None

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._proxy)

    async def _shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
        await super()._shutdown()

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        index = request[_INDEX]
        fault = self.schedule.fault(index)
        if fault is not None and fault.kind != "delay":
            with self._cond:
                self.injected[fault.kind] += 1
            self._record_fault(index, fault.kind)
            return await self._inject(request, fault)
        if fault is not None:  # delay: forwarded late
            with self._cond:
                self.injected["delay"] += 1
            self._record_fault(index, "delay")
            await asyncio.sleep(fault.delay_s)
        try:
            status, headers, body = await self._forward(request)
        except (ClientError, OSError, asyncio.TimeoutError) as exc:
            return _error(502, f"test proxy: upstream {self.upstream} failed: {exc!r}")
        with self._cond:
            self.forwarded += 1
        return web.Response(status=status, body=body, headers=headers)

    async def _forward(self, request: web.Request) -> tuple[int, dict[str, str], bytes]:
        if self._session is None:
            self._session = ClientSession(timeout=ClientTimeout(total=self.timeout_s))
        origin = self.upstream.split("://", 1)[0] + "://" + self.upstream.split("://", 1)[1].split("/", 1)[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with self._session.request(request.method, origin + request.path_qs, headers=headers,
                                         data=await request.read(), allow_redirects=False) as resp:
            body = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS | {"content-encoding"}}
            return resp.status, out, body

    async def _inject(self, request: web.Request, fault: Fault) -> web.StreamResponse:
        headers = {} if fault.retry_after is None else {"Retry-After": fault.retry_after}
        if fault.kind == "rate_limit":
            return _error(429, "rate limit reached (injected)", headers)
        if fault.kind == "server_error":
            return _error(500, "internal error (injected)")
        if fault.kind == "unavailable":
            return _error(503, "service unavailable (injected)", headers)
        if fault.kind == "drop":
            request.transport.close()  # type: ignore[union-attr]
            return web.Response(status=500)  # never reaches the client
        if fault.kind == "bad_json":
            return web.Response(status=200, body=b"<html>502 Bad Gateway</html>", content_type="application/json")
        if fault.kind == "deep_json":
            return web.Response(status=200, body=b"[" * 100_000 + b"]" * 100_000, content_type="application/json")
        if fault.kind == "error_200":
            return _error(200, "the engine is overloaded (injected)")
        if fault.kind == "gzip_bomb":
            return web.Response(status=200, body=gzip_bomb(_BOMB_MIB), content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        # truncate: the real answer, cut short, its full length announced, then the connection closed
        status, headers, body = await self._forward(request)
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        request.transport.close()  # type: ignore[union-attr]
        return resp


@functools.cache
def gzip_bomb(mib: int) -> bytes:
    """A valid gzip body, about a thousandth of its size, that inflates to a JSON object padded with ``mib`` MiB of
    spaces. A MiB of spaces is compressed once: after a full flush the compressor starts afresh, so the same bytes
    stand for every MiB."""
    head, block, tail = b'{"choices": [], "pad": ', b" " * 2**20, b"0}"
    deflate = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    start = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    middle = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.compress(tail) + deflate.flush(zlib.Z_FULL_FLUSH) + b"\x03\x00"  # a last, empty block
    crc = zlib.crc32(head)
    for _ in range(mib):
        crc = zlib.crc32(block, crc)
    size = len(head) + mib * len(block) + len(tail)
    return start + middle * mib + end + struct.pack("<II", zlib.crc32(tail, crc), size & 0xFFFFFFFF)


def _logprob_entry(step: Mapping[str, float], k: int) -> dict[str, Any]:
    ranked = list(step.items())
    token, logprob = ranked[0]
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ranked[:k]]}


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    return web.json_response({"error": {"message": message, "type": "test", "code": status}}, status=status,
                             headers=dict(headers or {}))


def _raw(answer: Raw) -> web.StreamResponse:
    body = answer.body
    if not isinstance(body, str | bytes):
        body = json.dumps(body)
    headers = dict(answer.headers)
    headers.setdefault("Content-Type", "application/json")
    return web.Response(status=answer.status, body=body.encode() if isinstance(body, str) else body, headers=headers)
