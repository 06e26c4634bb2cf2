"""The remote RM client against real HTTP servers on 127.0.0.1 (scripted upstreams, fault-injecting proxies): each
fault kind retried, Retry-After honoured, 4xx not retried, deadlines, least-outstanding routing and cool-down, the API
key kept to the configured hosts and out of logs, errors and stats, exactly-once outcomes under random faults and
cancellations, nothing left running after ``aclose()``. Waits are asserted as recorded by the client, never as wall
time; requests are held at server gates, not timed with sleeps."""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import ipaddress
import pickle
import logging
import random
import re
import ssl

import pytest

from verl_async_rm.errors import (EndpointClosedError, EndpointError, RequestTimeoutError, RewardModelError,
                                  TokenLimitError)
from verl_async_rm.endpoint_urls import check_endpoints
from verl_async_rm.remote.endpoints import EndpointClient, Reply, parse_retry_after
from verl_async_rm.remote.limits import RateLimits
from verl_async_rm.testing.fault_proxy import (FAULTS, Completion, Fault, FaultProxy, FaultSchedule, Raw,
                                               ScriptedUpstream)

pytestmark = pytest.mark.unit

CHAT = {"model": "judge", "messages": [{"role": "user", "content": "is 2 + 2 = 4 ?"}], "max_tokens": 4}
SECRET = "sk-test-9f8e7d6c5b4a-SECRET"


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


def deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def chat(client: EndpointClient, seconds: float = 5.0, **kwargs) -> Reply:
    return await client.post("/chat/completions", kwargs.pop("payload", CHAT), tokens=8, max_output_tokens=4,
                             deadline=deadline(seconds), **kwargs)


def client_for(*urls: str, **kwargs) -> EndpointClient:
    kwargs.setdefault("rng", random.Random(0))
    kwargs.setdefault("backoff_s", 0.01)  # retries' own waits kept short
    return EndpointClient(list(urls), **kwargs)


# ---------------------------------------------------------------------------------------------------- answers


@pytest.mark.asyncio
async def test_answers_come_back_with_endpoint_attempts_usage_and_stats(servers):
    upstream = servers(ScriptedUpstream(lambda p: Completion("yes", prompt_tokens=7, completion_tokens=1)))
    async with client_for(upstream.url, limits=RateLimits(max_tpm=10_000)) as client:
        reply = await chat(client)
        assert reply.body["choices"][0]["message"]["content"] == "yes"
        assert (reply.endpoint, reply.attempts, reply.waits_s) == (upstream.url, 1, ())
        assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (7, 1)
        stats = client.stats()
        assert (stats["requests"], stats["completed"], stats["tokens_in"], stats["tokens_out"]) == (1, 1, 7, 1)
        assert stats["limits"]["tokens_credited"] == 12 - 8  # reserved 8 + 4, the server counted 7 + 1
        assert stats["latency_ms"]["count"] == 1
        step = client.pop_step_stats()
        assert step["requests"] == 1 and step["retries"] == 0 and step["latency_ms_p50"] is not None
        assert client.pop_step_stats()["requests"] == 0


@pytest.mark.asyncio
async def test_logprobs_and_classify_shapes_of_the_scripted_upstream(servers):
    upstream = servers(ScriptedUpstream(
        lambda p: Completion("Yes", top_logprobs=[{"Yes": -0.1, "No": -2.4, "Maybe": -4.0}]),
        classify=lambda item: [0.25, 0.75], models=("judge", "rm")))
    async with client_for(upstream.url) as client:
        reply = await chat(client, payload={**CHAT, "logprobs": True, "top_logprobs": 2})
        step = reply.body["choices"][0]["logprobs"]["content"][0]
        assert step["token"] == "Yes" and [t["token"] for t in step["top_logprobs"]] == ["Yes", "No"]
        reply = await client.post("/classify", {"model": "rm", "input": ["a b", "c"]}, tokens=3,
                                  deadline=deadline(5), at_root=True)
        assert [d["probs"] for d in reply.body["data"]] == [[0.25, 0.75]] * 2
        assert reply.usage is not None and reply.usage.prompt_tokens == 3
        assert await client.models(5) == {upstream.url: ["judge", "rm"]}
        assert upstream.seen[1].path == "/classify"


@pytest.mark.asyncio
async def test_the_scripted_upstreams_latency_delays_each_answer_and_blocks_nothing_else(servers):
    slow = servers(ScriptedUpstream(latency_s=30.0))
    async with client_for(slow.url) as client:
        held = asyncio.ensure_future(chat(client, seconds=60))
        await slow.wait_until(lambda s: len(s.seen) == 1)
        assert await client.models(5) == {slow.url: ["judge"]}  # served while the chat answer waits
        assert not held.done()
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
    upstream = servers(ScriptedUpstream(latency_s=0.2))
    async with client_for(upstream.url) as client:
        reply = await chat(client)
    assert reply.latency_s >= 0.2 - 0.01 and reply.body["choices"][0]["message"]["content"]
    with pytest.raises(ValueError, match=r"latency_s=-1: give a finite number of seconds >= 0"):
        ScriptedUpstream(latency_s=-1)


# ---------------------------------------------------------------------------------------------------- retries


@pytest.mark.parametrize("kind", [k for k in FAULTS if k != "delay"])
@pytest.mark.asyncio
async def test_each_fault_kind_is_retried(servers, kind):
    upstream = servers(ScriptedUpstream())
    proxy = servers(FaultProxy(upstream.url, FaultSchedule({0: kind})))
    async with client_for(proxy.url) as client:
        reply = await chat(client)
        assert reply.body["choices"][0]["message"]["content"] == CHAT["messages"][0]["content"]
        assert reply.attempts == 2 and len(reply.waits_s) == 1
        assert proxy.injected == {kind: 1} and proxy.forwarded == 1
        stats = client.stats()
        assert stats["retries"] == 1 and stats["status_429"] == (kind == "rate_limit")
        assert stats["endpoint_errors"] == (kind != "rate_limit")


@pytest.mark.asyncio
async def test_retry_after_is_honoured_as_the_wait_before_the_retry(servers):
    upstream = servers(ScriptedUpstream())
    proxy = servers(FaultProxy(upstream.url, FaultSchedule({0: Fault("rate_limit", retry_after="0.2"),
                                                            1: Fault("unavailable", retry_after="0.1")})))
    async with client_for(proxy.url) as client:
        reply = await chat(client)
    assert reply.attempts == 3
    assert reply.waits_s[0] >= 0.2 - 0.01 and reply.waits_s[1] >= 0.1 - 0.01  # the loop clock moved on meanwhile


@pytest.mark.asyncio
async def test_on_the_last_endpoint_in_service_a_retry_after_holds_only_the_request_that_got_it(servers):
    upstream = servers(ScriptedUpstream())
    proxy = servers(FaultProxy(upstream.url, FaultSchedule({0: Fault("rate_limit", retry_after="30")})))
    async with client_for(proxy.url) as client:
        held = asyncio.ensure_future(chat(client, seconds=60))
        await proxy.wait_until(lambda p: len(p.seen) == 1)
        for _ in range(3):  # sent while the first one waits out its 30 s: answered at once
            assert (await chat(client)).attempts == 1
        assert not held.done() and client.stats()["endpoints_out"] == 0
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)


@pytest.mark.asyncio
async def test_with_another_endpoint_in_service_a_retry_after_takes_its_endpoint_out(servers):
    good = servers(ScriptedUpstream())
    limited = servers(FaultProxy(good.url, FaultSchedule({0: Fault("rate_limit", retry_after="30")})))
    async with client_for(limited.url, good.url) as client:
        replies = [await chat(client) for _ in range(4)]
        stats = client.stats()
    assert [(r.endpoint, r.attempts) for r in replies] == [(good.url, 2)] + [(good.url, 1)] * 3
    assert len(limited.seen) == 1 and stats["endpoints"][limited.url]["out_reason"] == "retry-after"


@pytest.mark.asyncio
async def test_a_retry_after_longer_than_max_retry_after_s_is_read_as_that(servers):
    """A ``Retry-After: 86400`` would take an endpoint out for a day: with max_retry_after_s=30 it is out for 30 s at
    most (another endpoint in service); on the last endpoint in service, with max_retry_after_s=0.2, the request that
    got it waits 0.2 s and is answered."""
    upstream = servers(ScriptedUpstream())
    day = FaultSchedule({0: Fault("rate_limit", retry_after="86400")})
    limited = servers(FaultProxy(upstream.url, day))
    async with client_for(limited.url, upstream.url, max_retry_after_s=30) as client:
        assert (await chat(client)).endpoint == upstream.url
        assert 0 < client.stats()["endpoints"][limited.url]["out_for_s"] <= 30
    alone = servers(FaultProxy(upstream.url, day))
    async with client_for(alone.url, max_retry_after_s=0.2) as client:
        reply = await chat(client, seconds=3600)
    assert reply.attempts == 2 and 0.2 - 0.01 <= reply.waits_s[0] <= 0.2 + 0.01  # the backoff draw is below 0.01
    assert EndpointClient("http://127.0.0.1:1/v1").max_retry_after_s == 60.0
    with pytest.raises(ValueError, match=r"max_retry_after_s=-1: give a finite number of seconds >= 0"):
        EndpointClient("http://127.0.0.1:1/v1", max_retry_after_s=-1)


@pytest.mark.asyncio
async def test_a_retry_after_past_the_deadline_fails_at_once(servers):
    upstream = servers(ScriptedUpstream())
    proxy = servers(FaultProxy(upstream.url, FaultSchedule({0: Fault("rate_limit", retry_after="30")})))
    async with client_for(proxy.url) as client:
        with pytest.raises(RequestTimeoutError, match=r"1 attempt\(s\).*Retry-After.*HTTP 429") as info:
            await chat(client, seconds=20)
        assert isinstance(info.value.__cause__, EndpointError) and info.value.__cause__.status == 429
        assert len(proxy.seen) == 1 and client.stats()["timed_out"] == 1


def test_retry_after_parses_seconds_and_http_dates():
    assert parse_retry_after("3") == 3.0 and parse_retry_after("0.5") == 0.5 and parse_retry_after("-2") == 0.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None and parse_retry_after("nan") is None
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert parse_retry_after(date, now=1_000_000.0) == 30.0
    assert parse_retry_after(date, now=1_000_100.0) == 0.0


@pytest.mark.parametrize("status, body, message", [
    (400, {"error": {"message": "model 'x' does not exist"}}, "model 'x' does not exist"),  # OpenAI's shape
    (401, {"error": "Unauthorized"}, "Unauthorized"),  # vLLM's --api-key check
    (404, {"detail": "Not Found"}, "Not Found"),  # a route the server lacks (vLLM: /classify on a generate model)
    (422, "plain text", "plain text")])
@pytest.mark.asyncio
async def test_other_4xx_fail_at_once_with_the_status_and_the_servers_message(servers, status, body, message):
    upstream = servers(ScriptedUpstream(lambda p: Raw(status, body)))
    async with client_for(upstream.url) as client:
        with pytest.raises(EndpointError, match=rf"HTTP {status}: {message}$") as info:
            await chat(client)
        assert isinstance(info.value, RewardModelError) and info.value.status == status
        assert info.value.endpoint == upstream.url
        assert len(upstream.seen) == 1 and client.stats()["client_errors"] == 1


@pytest.mark.asyncio
async def test_a_server_slower_than_the_deadline_times_out_naming_the_endpoint(servers):
    upstream = servers(ScriptedUpstream())
    proxy = servers(FaultProxy(upstream.url, FaultSchedule({0: Fault("delay", delay_s=30)})))
    async with client_for(proxy.url) as client:
        with pytest.raises(RequestTimeoutError, match=rf"1 attempt\(s\) on {proxy.url}.*no answer") as info:
            await chat(client, seconds=0.2)
        assert isinstance(info.value.__cause__, EndpointError)
        assert client.stats()["in_flight"] == 0


@pytest.mark.asyncio
async def test_an_attempt_past_attempt_timeout_s_fails_its_endpoint_and_the_request_goes_to_another(servers, caplog):
    """One endpoint answers its first request, then accepts every other and never answers (a proxy whose ``delay``
    outlasts the test), one is live. With a deadline of a minute and attempt_timeout_s=0.5, every request is answered
    by its second attempt at the latest: each hung attempt is cut at 0.5 s, counted against the hung endpoint (which
    is cooled down) and retried on the live one. (Before, an attempt's bound was the time left: each request sent to
    the hung endpoint waited for its deadline and timed out.)"""
    live = servers(ScriptedUpstream())
    hung = servers(FaultProxy(live.url, FaultSchedule({0: None}, rate=1.0, kinds=["delay"], delay_s=3600)))
    caplog.set_level(logging.DEBUG, logger="verl_async_rm.remote.endpoints")
    async with client_for(hung.url, live.url, attempt_timeout_s=0.5) as client:
        assert (await chat(client, seconds=60)).endpoint == hung.url  # its first answer
        replies = await asyncio.gather(*(chat(client, seconds=60) for _ in range(40)))
        stats = client.stats()
    hung_attempts = len(hung.seen) - 1
    assert hung_attempts >= 1 and all(r.endpoint == live.url for r in replies)
    assert sorted(r.attempts for r in replies) == [1] * (40 - hung_attempts) + [2] * hung_attempts
    assert stats["endpoints"][hung.url]["errors"] == hung_attempts == stats["endpoint_errors"]
    assert stats["cooldowns"] == 1 and stats["timed_out"] == 0 and stats["completed"] == 41
    assert caplog.text.count("no answer within attempt_timeout_s=0.5 s") == hung_attempts


@pytest.mark.asyncio
async def test_an_attempt_the_deadline_cuts_short_keeps_the_error_that_made_it_retry(servers):
    """A 500, then an attempt still unanswered at the deadline: the timeout's cause is the 500, not the cut."""
    upstream = servers(ScriptedUpstream())
    proxy = servers(FaultProxy(upstream.url, FaultSchedule({0: Fault("server_error"), 1: Fault("delay", delay_s=30)})))
    async with client_for(proxy.url) as client:
        with pytest.raises(RequestTimeoutError, match=r"2 attempt\(s\) on .*ran out of time; last error: .*500") \
                as info:
            await chat(client, seconds=0.5)
        assert isinstance(info.value.__cause__, EndpointError) and info.value.__cause__.status == 500


@pytest.mark.asyncio
async def test_retries_stop_at_the_deadline_with_the_last_error(servers):
    upstream = servers(ScriptedUpstream(lambda p: Raw(500, {"error": {"message": "engine died"}})))
    async with client_for(upstream.url, cooldown_s=60, backoff_s=0.01) as client:
        with pytest.raises(RequestTimeoutError, match=r"attempt\(s\) on .*HTTP 500: engine died"):
            await chat(client, seconds=0.5)
        # the lone endpoint is never taken out for a cool-down: backoff paced the retries up to the deadline
        assert len(upstream.seen) > 3 and client.stats()["cooldowns"] == 0 and client.stats()["endpoints_out"] == 0


# ---------------------------------------------------------------------------------------------------- routing


@pytest.mark.asyncio
async def test_least_outstanding_routing_with_ties_in_turn(servers):
    ups = [servers(ScriptedUpstream()) for _ in range(3)]
    for up in ups:
        up.close_gate()
    async with client_for(*(u.url for u in ups)) as client:
        first = [asyncio.ensure_future(chat(client)) for _ in range(6)]
        for up in ups:
            await up.wait_until(lambda s: s.held == 2)  # ties in turn: two each
        ups[0].open_gate()
        for reply in await asyncio.gather(*first[0:6:3]):
            assert reply.endpoint == ups[0].url
        await ups[0].wait_until(lambda s: s.held == 0)
        ups[0].close_gate()
        late = [asyncio.ensure_future(chat(client)) for _ in range(2)]  # the idle endpoint takes both
        await ups[0].wait_until(lambda s: s.held == 2)
        assert client.stats()["endpoints"][ups[0].url]["outstanding"] == 2
        for up in ups:
            up.open_gate()
        replies = await asyncio.gather(*first, *late)
    assert [r.endpoint for r in replies[-2:]] == [ups[0].url] * 2
    assert [len(u.seen) for u in ups] == [4, 2, 2]


@pytest.mark.asyncio
async def test_a_failing_endpoint_is_cooled_down_and_its_requests_go_to_the_others(servers):
    good = servers(ScriptedUpstream())
    bad = servers(FaultProxy(good.url, FaultSchedule(rate=1.0, kinds=["server_error"])))
    async with client_for(bad.url, good.url, cooldown_s=60) as client:
        for _ in range(6):
            reply = await chat(client)
            assert reply.endpoint == good.url  # a retry goes to the other endpoint
        stats = client.stats()
    assert len(bad.seen) == 3 and stats["cooldowns"] == 1  # out after the third failure
    assert stats["endpoints"][bad.url]["out_reason"] == "cool-down" and stats["endpoints_out"] == 1


@pytest.mark.asyncio
async def test_the_last_endpoint_in_service_is_never_cooled_down(servers):
    upstream = servers(ScriptedUpstream())
    broken = servers(FaultProxy(upstream.url, FaultSchedule(rate=1.0, kinds=["server_error"])))
    flaky = servers(FaultProxy(upstream.url, FaultSchedule(["drop", "server_error", "drop", "server_error"])))
    async with client_for(broken.url, flaky.url, cooldown_s=60, backoff_s=0.01) as client:
        reply = await chat(client, seconds=10)
        stats = client.stats()
    # attempts alternate until the broken one's third failure takes it out; the flaky one, then alone in service,
    # stays in through its third and fourth failures and serves the fifth attempt sent to it
    assert reply.endpoint == flaky.url and reply.attempts == 8 and len(broken.seen) == 3
    assert stats["cooldowns"] == 1 and stats["endpoints"][broken.url]["out_reason"] == "cool-down"
    assert stats["endpoints"][flaky.url]["out_reason"] is None


@pytest.mark.asyncio
async def test_failures_in_flight_while_out_do_not_extend_the_cool_down():
    # white-box on purpose: the order of failures must be exact (a request sent before the cool-down failing later)
    async with client_for("http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1", cooldown_s=10) as client:
        client._bind()
        first = client._endpoints[0]
        for _ in range(3):
            client._count_failure(first, client._counts)
        out_for = client.stats()["endpoints"][first.url]["out_for_s"]
        await asyncio.sleep(0.05)
        client._count_failure(first, client._counts)  # a request in flight since before the cool-down fails now
        stats = client.stats()
    assert stats["cooldowns"] == 1 and 9.9 < out_for <= 10
    assert stats["endpoints"][first.url]["out_for_s"] <= out_for - 0.05


# ---------------------------------------------------------------------------------------------------- security


@pytest.mark.asyncio
async def test_the_key_is_sent_to_the_endpoint_and_never_logged_raised_or_reported(servers, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    echo = ScriptedUpstream(lambda p: Raw(401, {"error": {"message": f"Incorrect API key provided: {SECRET}"}}))
    upstream = servers(echo)
    other = servers(ScriptedUpstream())
    proxy = servers(FaultProxy(other.url, FaultSchedule(rate=1.0, kinds=["drop"])))
    caplog.set_level(logging.DEBUG)
    client = client_for(upstream.url, api_key_env="JUDGE_KEY")
    with pytest.raises(EndpointError) as refused:
        await chat(client)
    faulty = client_for(proxy.url, api_key_env="JUDGE_KEY", cooldown_s=0.01, backoff_s=0.01)
    with pytest.raises(RequestTimeoutError) as timed_out:
        await chat(faulty, seconds=0.3)
    assert upstream.seen[0].headers["authorization"] == f"Bearer {SECRET}"
    texts = [str(refused.value), repr(refused.value), str(timed_out.value), str(timed_out.value.__cause__),
             repr(client), repr(vars(client)), str(client.stats()), str(faulty.stats()), str(client.pop_step_stats()),
             caplog.text]
    assert "JUDGE_KEY" in repr(client)
    assert all(SECRET not in text for text in texts)
    await client.aclose()
    await faulty.aclose()


@pytest.mark.asyncio
async def test_a_redirect_to_another_host_is_not_followed_and_gets_no_key(servers, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    elsewhere = servers(ScriptedUpstream())
    mover = servers(ScriptedUpstream(lambda p: Raw(307, "", {"Location": elsewhere.url + "/chat/completions"})))
    async with client_for(mover.url, api_key_env="JUDGE_KEY") as client:
        with pytest.raises(EndpointError, match=r"307 redirecting to .*not followed") as info:
            await chat(client)
    assert info.value.status == 307 and elsewhere.seen == []


def self_signed(tmp_path) -> tuple[ssl.SSLContext, str]:
    """A server TLS context for 127.0.0.1 and the path of its (self-signed) certificate."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    return context, str(cert_path)


@pytest.mark.asyncio
async def test_https_certificates_are_checked_by_default(servers, tmp_path, monkeypatch):
    context, cert = self_signed(tmp_path)
    upstream = servers(ScriptedUpstream(tls=context))
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    async with client_for(upstream.url) as client:  # an unknown CA: fails at once, not retried
        with pytest.raises(EndpointError, match="certificate failed the check.*SSL_CERT_FILE=<path>"):
            await chat(client)
        assert client.stats()["attempts"] == 1
    async with client_for(upstream.url, verify=cert) as client:  # its CA given: served
        assert (await chat(client)).endpoint.startswith("https://")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # how a user gives it: the variable Python's ssl reads
    async with client_for(upstream.url) as client:
        assert (await chat(client)).endpoint.startswith("https://")


def test_a_missing_key_variable_is_a_config_error(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR is not set"):
        EndpointClient("http://127.0.0.1:1/v1", api_key_env="NO_SUCH_KEY_VAR")


def test_check_endpoints_normalises_and_names_bad_values():
    assert check_endpoints(["http://a:1/v1/", "https://b/v1"]) == ("http://a:1/v1", "https://b/v1")
    assert check_endpoints("http://a:1/v1") == ("http://a:1/v1",)
    for bad, why in [([], "at least one"), ("localhost:8000/v1", "scheme"), ("ftp://h/v1", "scheme"),
                     (["http://a/v1", "http://a/v1/"], "twice"), ("http://a/v1?x=1", "query"), ([3], "string")]:
        with pytest.raises(ValueError, match=why):
            check_endpoints(bad, key="rm.urls")
    with pytest.raises(ValueError, match="credentials") as info:
        check_endpoints("http://user:hunter2@h/v1")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("url, fix", [
    ("file:///x", "http://<host>:<port>/v1"),  # was: "write it as http:///x"
    ("localhost:8000/v1", "http://localhost:8000/v1"),
    ("judge-node:8000", "http://judge-node:8000/v1"),
    ("ftp://h/v1", "http://h/v1"),
    ("http//h/v1", "http://h/v1")])
def test_a_url_without_http_gets_a_fix_that_is_a_base_url(url, fix):
    with pytest.raises(ValueError, match="needs a scheme") as info:
        check_endpoints(url, key="endpoint")
    assert str(info.value).endswith(f"Fix: write it as {fix} (or https://)")
    if "<" not in fix:
        assert check_endpoints(fix) == (fix,)  # the fix itself is accepted


@pytest.mark.parametrize("url, route, base", [
    ("http://h:8000/v1/chat/completions", "/chat/completions", "http://h:8000/v1"),
    ("http://h:8000/v1/completions/", "/completions", "http://h:8000/v1"),
    ("http://h:8000/classify", "/classify", "http://h:8000/v1"),
    ("https://api.example.com/openai/v1/models", "/models", "https://api.example.com/openai/v1")])
def test_a_url_that_ends_with_an_api_route_is_refused_naming_the_base_url(url, route, base):
    with pytest.raises(ValueError, match=rf"ends with the API route {route}, .*Fix: give the base URL, {base}$"):
        check_endpoints(url, key="endpoint")


@pytest.mark.parametrize("urls", [
    ["http://localhost:8000/v1", "http://127.0.0.1:8000/v1"],
    ["http://[::1]:8000/v1", "http://localhost:8000/v1/"],
    ["http://127.0.0.1:8000/v1", "http://[::1]:8000/v1"],
    ["http://h/v1", "http://H:80/v1"]])
def test_one_server_under_two_names_is_listed_twice(urls):
    with pytest.raises(ValueError, match=r"is listed twice \(as " + re.escape(urls[0].rstrip("/"))):
        check_endpoints(urls, key="endpoint")


def test_servers_on_other_ports_or_paths_are_other_endpoints():
    urls = ["http://localhost:8000/v1", "http://127.0.0.1:8001/v1", "http://localhost:8000/v2", "https://localhost/v1"]
    assert check_endpoints(urls) == tuple(urls)


# ---------------------------------------------------------------------------------------------------- lifecycle


@pytest.mark.asyncio
async def test_limits_bound_the_requests_in_flight(servers):
    ups = [servers(ScriptedUpstream()) for _ in range(2)]
    for up in ups:
        up.close_gate()
    async with client_for(*(u.url for u in ups), limits=RateLimits(max_concurrency=1)) as client:
        tasks = [asyncio.ensure_future(chat(client)) for _ in range(3)]
        await ups[0].wait_until(lambda s: s.held == 1)
        assert ups[1].held == 0 and client.stats()["limits"]["waiting"] == 2
        for up in ups:
            up.open_gate()
        await asyncio.gather(*tasks)
    client2 = client_for(ups[0].url, limits=RateLimits(max_tpm=10))
    with pytest.raises(TokenLimitError, match="12 tokens.*max_tpm=10"):
        await chat(client2)
    assert client2.stats()["failed"] == 1
    await client2.aclose()


@pytest.mark.asyncio
async def test_a_cancelled_caller_cancels_its_request_and_frees_its_slot(servers):
    upstream = servers(ScriptedUpstream())
    upstream.close_gate()
    async with client_for(upstream.url, limits=RateLimits(max_concurrency=1)) as client:
        task = asyncio.ensure_future(chat(client))
        await upstream.wait_until(lambda s: s.held == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        upstream.open_gate()
        assert (await chat(client)).attempts == 1  # the slot is free again
        stats = client.stats()
    assert stats["cancelled"] == 1 and stats["completed"] == 1 and stats["limits"]["in_flight"] == 0


@pytest.mark.asyncio
async def test_aclose_fails_requests_in_flight_and_leaves_nothing_running(servers):
    upstream = servers(ScriptedUpstream())
    upstream.close_gate()
    before = asyncio.all_tasks()
    client = client_for(upstream.url)
    tasks = [asyncio.ensure_future(chat(client)) for _ in range(4)]
    await upstream.wait_until(lambda s: s.held == 4)
    await client.aclose()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, EndpointClosedError) for r in results)
    assert asyncio.all_tasks() == before and client.stats()["in_flight"] == 0
    assert client.stats()["failed"] == 4 and client._http.is_closed
    with pytest.raises(EndpointClosedError):
        await chat(client)
    await client.aclose()  # idempotent
    upstream.open_gate()


@pytest.mark.asyncio
async def test_models_names_every_endpoint_that_fails(servers):
    up = servers(ScriptedUpstream(models=("judge",)))
    dead = ScriptedUpstream().start()
    dead_url = dead.url
    dead.stop()  # its port is closed now
    async with client_for(up.url, dead_url) as client:
        with pytest.raises(EndpointError, match=rf"1 of 2 .*{dead_url}: .*ConnectError"):
            await client.models(1)


@pytest.mark.asyncio
async def test_resolve_model_requires_endpoint_model_when_a_server_lists_several(servers, caplog):
    """Unset endpoint_model once meant the first model listed (a gateway's, or a LoRA module of vLLM's): now the one
    model the endpoints list, else a ValueError that lists them and names the fix."""
    lora = servers(ScriptedUpstream(models=("judge", "judge-lora")))
    single = servers(ScriptedUpstream(models=("judge",)))
    other = servers(ScriptedUpstream(models=("critic",)))
    caplog.set_level(logging.INFO, logger="verl_async_rm.remote.endpoints")
    async with client_for(lora.url) as client:
        with pytest.raises(ValueError, match=rf"endpoint \['{lora.url}'\] lists .*'judge', 'judge-lora'.*Fix: set "
                                             "endpoint_model"):
            await client.resolve_model(None)
        assert await client.resolve_model("judge-lora") == "judge-lora"
        with pytest.raises(ValueError, match=rf"endpoint \['{lora.url}'\] does not serve model 'other' .*Fix: set "
                                             "endpoint_model to one it serves"):
            await client.resolve_model("other")
        assert client.pop_step_stats()["requests"] == 0  # a start-up check, not a step's requests
    async with client_for(single.url) as client:
        assert await client.resolve_model(None) == "judge"
    assert f"endpoint ['{single.url}']: using model 'judge', the one it lists" in caplog.text
    async with client_for(single.url, other.url) as client:  # one model each, not the same one
        with pytest.raises(ValueError, match="endpoint_model is not set, which is allowed only when the endpoints "
                                             "list one model, the same"):
            await client.resolve_model(None)
        with pytest.raises(ValueError, match=rf"endpoint \['{other.url}'\] does not serve model 'judge'"):
            await client.resolve_model("judge")


@pytest.mark.asyncio
async def test_resolve_model_lists_through_the_retry_path_of_post(servers):
    """The model list is asked through post's one retry path, not a loop of its own: a 503 and a 429 are retried
    (Retry-After honoured), an attempt with no answer is cut at attempt_timeout_s and retried, a 401 fails at once,
    an unreachable endpoint fails when timeout_s runs out; each a ValueError naming the URL and the fix."""
    answers = iter([Raw(503, {"error": "loading"}), Raw(429, {"error": "slow down"}, {"Retry-After": "0.1"})])
    upstream = servers(ScriptedUpstream(list_models=lambda: next(answers, None)))
    async with client_for(upstream.url) as client:
        assert await client.resolve_model("judge", timeout_s=10) == "judge"
        assert [s.path for s in upstream.seen] == ["/v1/models"] * 3
        assert client.stats()["endpoints"][upstream.url]["attempts"] == 3
    hung = servers(FaultProxy(upstream.url, FaultSchedule({0: Fault("delay", delay_s=3600)})))
    async with client_for(hung.url, attempt_timeout_s=0.3) as client:
        assert await client.resolve_model(None, timeout_s=60) == "judge"
        assert len(hung.seen) == 2 and client.stats()["endpoints"][hung.url]["errors"] == 1
    refused = servers(ScriptedUpstream(list_models=lambda: Raw(401, {"error": "Unauthorized"})))
    async with client_for(refused.url) as client:
        with pytest.raises(ValueError, match=rf"endpoint \['{refused.url}'\]: could not list its models .*HTTP 401: "
                                             "Unauthorized.*Fix: start the server.*api_key_env"):
            await client.resolve_model("judge", timeout_s=60)
        assert len(refused.seen) == 1
    dead = ScriptedUpstream().start()
    dead.stop()  # its port is closed now
    async with client_for(dead.url) as client:
        with pytest.raises(ValueError, match=r"could not list its models .*missed its deadline .*ConnectError.*Fix"):
            await client.resolve_model("judge", timeout_s=0.5)
        assert client.stats()["endpoints"][dead.url]["attempts"] > 1


@pytest.mark.asyncio
async def test_every_request_resolves_exactly_once_under_random_faults_and_cancellations(servers):
    """Fuzz: two faulty proxies over one upstream, short deadlines, callers cancelled at random moments."""
    upstream = servers(ScriptedUpstream())
    proxies = [servers(FaultProxy(upstream.url, FaultSchedule(rate=0.4, seed=seed, delay_s=0.5))) for seed in (1, 2)]
    rng = random.Random(7)
    client = client_for(*(p.url for p in proxies), limits=RateLimits(max_concurrency=6), cooldown_s=0.05,
                        backoff_s=0.01)

    async def caller(i: int):
        task = asyncio.ensure_future(chat(client, seconds=rng.uniform(0.2, 1.0)))
        if rng.random() < 0.25:
            await asyncio.sleep(rng.uniform(0, 0.05))  # a random moment, not a correctness wait
            task.cancel()
        try:
            return await task
        except BaseException as exc:  # noqa: BLE001 - the outcome is what is checked
            return exc

    outcomes = await asyncio.gather(*(caller(i) for i in range(60)))
    kinds = [type(o).__name__ for o in outcomes]
    allowed = {"Reply", "RequestTimeoutError", "EndpointError", "CancelledError"}
    assert set(kinds) <= allowed, kinds
    stats = client.stats()
    assert stats["requests"] == 60
    assert (stats["completed"], stats["timed_out"], stats["cancelled"]) == (
        kinds.count("Reply"), kinds.count("RequestTimeoutError"), kinds.count("CancelledError"))
    assert stats["failed"] == kinds.count("EndpointError")
    assert stats["in_flight"] == 0 and stats["limits"]["in_flight"] == 0 and stats["limits"]["waiting"] == 0
    assert all(ep["outstanding"] == 0 for ep in stats["endpoints"].values())
    assert kinds.count("Reply") > 0 and sum(sum(p.injected.values()) for p in proxies) > 0
    await client.aclose()


@pytest.mark.asyncio
async def test_the_test_servers_bound_their_load(servers):
    upstream = servers(ScriptedUpstream(max_requests=1))
    async with client_for(upstream.url) as client:
        await chat(client)
        with pytest.raises(EndpointError, match="HTTP 410: test server: max_requests=1 reached"):
            await chat(client)


def test_endpoint_errors_cross_process_boundaries_with_their_fields():
    err = EndpointError("http://h/v1: HTTP 400: bad", endpoint="http://h/v1", status=400)
    timeout = RequestTimeoutError("missed its deadline")
    timeout.__cause__ = err
    back = pickle.loads(pickle.dumps(timeout))
    assert isinstance(back.__cause__, EndpointError) and isinstance(back.__cause__, RewardModelError)
    assert (back.__cause__.endpoint, back.__cause__.status, str(back.__cause__)) == (err.endpoint, 400, str(err))
    assert str(pickle.loads(pickle.dumps(TokenLimitError("too large")))) == "too large"
    assert isinstance(pickle.loads(pickle.dumps(EndpointClosedError("closed"))), EndpointClosedError)
