"""What an endpoint answers cannot break the remote RM client: a body that does not read as a JSON object (bad syntax or
encoding, nesting deeper than the parser's stack, a list) or a 200 carrying an error object is an endpoint failure and
is retried; a body is read up to a cap on its decoded size (a small gzip body that inflates past it is not inflated
whole); a bogus ``usage`` counts at most 4x the request's reservation in the rate limits; a key the server echoes is
masked everywhere. Real HTTP on 127.0.0.1: a scripted upstream serves each bad answer exactly once (then good ones),
or every time where the test says so."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import logging
import random
import re
import tracemalloc
import zlib

import pytest

from verl_async_rm.errors import EndpointError, RequestTimeoutError
from verl_async_rm.remote.endpoints import MAX_BODY_BYTES, EndpointClient, Reply, Usage
from verl_async_rm.remote.limits import RateLimits
from verl_async_rm.testing.fault_proxy import Raw, ScriptedUpstream, gzip_bomb

pytestmark = pytest.mark.unit

CHAT = {"model": "judge", "messages": [{"role": "user", "content": "is 2 + 2 = 4 ?"}], "max_tokens": 4}
OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"}}]}


@pytest.fixture
def servers():
    """``start(server)``: starts it now, stops it when the test ends."""
    started = []

    def start(server):
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def first_then_ok(first: Raw):
    """A chat function: ``first`` for the first request, :data:`OK` for every later one."""
    calls = itertools.count()
    return lambda payload: first if next(calls) == 0 else Raw(200, OK)


async def chat(client: EndpointClient, seconds: float = 10.0) -> Reply:
    return await client.post("/chat/completions", CHAT, tokens=8, max_output_tokens=4,
                             deadline=asyncio.get_running_loop().time() + seconds)


def client_for(*urls: str, **kwargs) -> EndpointClient:
    return EndpointClient(list(urls), rng=random.Random(0), backoff_s=0.01, **kwargs)


# ---------------------------------------------------------------------------------------------------- malformed


@pytest.mark.parametrize("status, body, why", [
    (200, b"<html>502 Bad Gateway</html>", "not a JSON object"),
    (200, b"[" * 100_000 + b"]" * 100_000, "not a JSON object"),  # json raises RecursionError on it
    (200, b"\xff\xfe\x00\x01{", "not a JSON object"),  # not UTF-8
    (200, b"1" * 5_000, "not a JSON object"),  # an integer longer than Python converts
    (200, b"[1, 2]", "not a JSON object"),
    (200, b'"yes"', "not a JSON object"),
    (200, b"null", "not a JSON object"),
    (200, b'{"error": {"message": "the engine is overloaded", "code": 503}}', "error and no result: the engine is"),
    (200, b'{"error": "the engine is overloaded"}', "error and no result: the engine is overloaded"),
    (500, b"[" * 100_000 + b"]" * 100_000, r"HTTP 500: \[\[\[\["),  # an error's body is read as text then
])
@pytest.mark.asyncio
async def test_a_body_that_is_not_a_json_object_or_is_an_error_is_an_endpoint_failure_and_retried(
        servers, caplog, status, body, why):
    upstream = servers(ScriptedUpstream(first_then_ok(Raw(status, body))))
    caplog.set_level(logging.DEBUG, logger="verl_async_rm.remote.endpoints")
    async with client_for(upstream.url) as client:
        reply = await chat(client)
        stats = client.stats()
    assert reply.body == OK and reply.attempts == 2
    assert stats["endpoint_errors"] == 1 and stats["retries"] == 1
    logged = caplog.records[0].getMessage()
    assert logged.startswith("request to /chat/completions: attempt 1 failed") and re.search(why, logged)


@pytest.mark.asyncio
async def test_a_body_that_never_reads_ends_in_a_typed_error_with_the_last_failure(servers):
    """Every answer nests deeper than the parser's stack: retried to the deadline, then ``RequestTimeoutError``
    (nothing else escapes), its cause the endpoint's failure."""
    upstream = servers(ScriptedUpstream(lambda payload: Raw(200, b"[" * 100_000 + b"]" * 100_000)))
    async with client_for(upstream.url) as client:
        with pytest.raises(RequestTimeoutError, match="not a JSON object") as info:
            await chat(client, seconds=0.5)
    assert isinstance(info.value.__cause__, EndpointError) and info.value.__cause__.status == 200
    assert len(upstream.seen) >= 2


@pytest.mark.asyncio
async def test_an_error_field_beside_a_result_or_null_is_not_an_error(servers):
    bodies = iter([{**OK, "error": None}, {**OK, "error": {"message": "a warning"}}, {"data": [], "error": "x"}])
    upstream = servers(ScriptedUpstream(lambda payload: Raw(200, next(bodies))))
    async with client_for(upstream.url) as client:
        replies = [await chat(client) for _ in range(3)]
    assert [r.attempts for r in replies] == [1, 1, 1] and client.stats()["endpoint_errors"] == 0


# ---------------------------------------------------------------------------------------------------- size cap


@pytest.mark.asyncio
async def test_a_gzip_body_is_inflated_only_up_to_the_cap(servers, caplog):
    """A 200 kB gzip body that inflates to 200 MiB (the issue's finding): the client stops at MAX_BODY_BYTES (16
    MiB), fails the attempt and retries; the memory it took stays within a few times the cap, far from 200 MiB."""
    bomb = gzip_bomb(200)
    assert len(bomb) < 250_000
    upstream = servers(ScriptedUpstream(first_then_ok(Raw(200, bomb, {"Content-Encoding": "gzip"}))))
    caplog.set_level(logging.DEBUG, logger="verl_async_rm.remote.endpoints")
    async with client_for(upstream.url) as client:
        tracemalloc.start()
        try:
            reply = await chat(client)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        stats = client.stats()
    assert reply.body == OK and reply.attempts == 2 and stats["endpoint_errors"] == 1
    assert f"a body over {MAX_BODY_BYTES} bytes (decoded)" in caplog.text
    assert peak < 3 * MAX_BODY_BYTES, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.asyncio
async def test_a_body_of_exactly_the_cap_is_read_and_one_byte_more_is_not(servers):
    head, tail, pad = b'{"choices": [], "pad": "', b'"}', MAX_BODY_BYTES - 26
    bodies = iter([Raw(200, head + b"x" * pad + tail), Raw(200, head + b"x" * (pad + 1) + tail), Raw(200, OK)])
    upstream = servers(ScriptedUpstream(lambda payload: next(bodies)))
    async with client_for(upstream.url) as client:
        whole = await chat(client)
        retried = await chat(client)
    assert len(whole.body["pad"]) == pad and whole.attempts == 1
    assert retried.body == OK and retried.attempts == 2


@pytest.mark.parametrize("coding, encode", [("gzip", gzip.compress), ("deflate", zlib.compress)])
@pytest.mark.asyncio
async def test_gzip_and_deflate_bodies_are_read(servers, coding, encode):
    upstream = servers(ScriptedUpstream(lambda payload: Raw(200, encode(json.dumps(OK).encode()),
                                                            {"Content-Encoding": coding})))
    async with client_for(upstream.url) as client:
        reply = await chat(client)
    assert reply.body == OK and reply.attempts == 1
    assert upstream.seen[0].headers["accept-encoding"] == "gzip, deflate"


@pytest.mark.parametrize("coding, body", [("br", b"\x8b\x02\x80{}\x03"), ("gzip", b"\x1f\x8b not gzip")])
@pytest.mark.asyncio
async def test_a_body_in_a_coding_not_asked_for_or_corrupt_is_an_endpoint_failure(servers, coding, body):
    upstream = servers(ScriptedUpstream(first_then_ok(Raw(200, body, {"Content-Encoding": coding}))))
    async with client_for(upstream.url) as client:
        reply = await chat(client)
    assert reply.body == OK and reply.attempts == 2 and client.stats()["endpoint_errors"] == 1


# ---------------------------------------------------------------------------------------------------- usage


@pytest.mark.asyncio
async def test_a_bogus_usage_counts_at_most_four_times_the_reservation_with_one_warning_naming_the_endpoint(
        servers, caplog):
    """``prompt_tokens=10**9`` under max_tpm=6000: the limiter debits 4x the 12 tokens reserved (not 10^9: every later
    request would wait for months), a warning names the endpoint once; a usage that is not a count is ignored."""
    usages = iter([{"prompt_tokens": 10**9, "completion_tokens": 1}] * 2 +
                  [{"prompt_tokens": 1e9}, {"prompt_tokens": True}, {"prompt_tokens": -7},
                   {"prompt_tokens": 5, "completion_tokens": 2.5}, {"prompt_tokens": 5, "completion_tokens": None}])
    upstream = servers(ScriptedUpstream(lambda payload: Raw(200, {**OK, "usage": next(usages)})))
    caplog.set_level(logging.WARNING, logger="verl_async_rm.remote.endpoints")
    async with client_for(upstream.url, limits=RateLimits(max_tpm=6000)) as client:
        replies = [await chat(client) for _ in range(7)]
        limits = client.stats()["limits"]
    assert limits["tokens_debited"] == 2 * (4 * 12 - 12)
    assert limits["tokens_available"] > 6000 - 300  # nothing holds the bucket down
    assert [r.usage for r in replies[2:6]] == [None] * 4 and replies[6].usage == Usage(5, 0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and upstream.url in warnings[0] and "1000000001 tokens" in warnings[0]


# ---------------------------------------------------------------------------------------------------- the key


KEY = "sk-echo-7Qz9Xw2Lm4Np8Rt6Vb3Kd5"
#: Where a server echoes the key: each case is (status, body, headers); the key sits where a cut of the message (at
#: 500 characters, or 200 for a body that is not JSON) would go through it.
ECHOES = {
    "error_message": (401, {"error": {"message": "m" * 490 + " " + KEY}}, {}),
    "error_text": (403, "t" * 495 + KEY + " trailing", {}),
    "not_json_200": (200, "<html>" + "h" * 190 + KEY + "</html>", {}),
    "error_object_200": (200, {"error": "x" * 495 + KEY}, {}),
    "server_error": (503, {"detail": KEY * 40}, {}),
    "redirect": (307, "", {"Location": f"http://elsewhere.test/v1/chat/completions?key={KEY}"}),
    "models": (200, {"object": "list", "models": "q" * 190 + KEY}, {}),  # /models answered with no model list
}


@pytest.mark.asyncio
async def test_a_key_the_server_echoes_anywhere_appears_nowhere_not_even_eight_characters_of_it(
        servers, monkeypatch, caplog):
    """Errors used to be cut to 500/200 characters before the key was masked (a 20-character prefix of it was left),
    and a redirect's Location was not masked: now no 8 consecutive characters of the key appear in any error, log
    line or statistic, whatever body or header echoes it. ``scrub`` is the mask callers apply to reply bodies."""
    monkeypatch.setenv("ECHO_KEY", KEY)
    upstream = servers(ScriptedUpstream(lambda payload: Raw(*ECHOES[payload["messages"][0]["content"]])))
    models = servers(ScriptedUpstream(list_models=lambda: Raw(*ECHOES["models"])))
    caplog.set_level(logging.DEBUG, logger="verl_async_rm")  # the client's log lines (httpcore's trace is its own)
    texts = []
    async with client_for(upstream.url, api_key_env="ECHO_KEY") as client:
        for case in ECHOES:
            if case == "models":
                continue
            with pytest.raises((EndpointError, RequestTimeoutError)) as info:
                await client.post("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": case}]},
                                  tokens=8, deadline=asyncio.get_running_loop().time() + 0.3)
            texts += [str(info.value), repr(info.value), str(info.value.__cause__)]
        texts += [str(client.stats()), str(client.pop_step_stats()), client.scrub(f"echo: {KEY}.")]
    async with client_for(models.url, api_key_env="ECHO_KEY") as client:
        with pytest.raises(EndpointError) as info:
            await client.models(5)
        texts += [str(info.value), str(client.stats())]
    assert upstream.seen[0].headers["authorization"] == f"Bearer {KEY}" and len(texts) == 3 * 6 + 3 + 2
    texts.append(caplog.text)
    windows = {KEY[i:i + 8] for i in range(len(KEY) - 7)}
    leaks = {w for w in windows for text in texts if w in text}
    assert not leaks, leaks
