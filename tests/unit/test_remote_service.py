"""``RemoteRMService`` in this process (the Ray actor's class, no Ray) against real HTTP servers on 127.0.0.1: the
scripted OpenAI-compatible upstream (a stand-in for the model: the test controls each answer) and the fault proxy
(a stand-in for a flaky network: it injects faults on a seeded schedule). What is under test is the service: what it
asks, how it reads the answer, what a failure gives (an error value, never a score standing in) and its figures.
The same service against vLLM's own server: ``tests/integration/test_remote_rms.py``."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest

from verl_async_rm.errors import EndpointError, JudgeVerdictError, RequestTimeoutError, RewardModelError
from verl_async_rm.request import RMRequest, Verdict
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.remote_service import REMOTE_FIGURES, RemoteRMService, probe
from verl_async_rm.testing.fault_proxy import Completion, FaultProxy, FaultSchedule, Raw, ScriptedUpstream

pytestmark = pytest.mark.unit

TOKENS = ("Yes", "No")


def request(policy_tok, i: int, answer: str = "It is four.") -> RMRequest:
    prompt = [{"role": "user", "content": f"What is 2 + {i}?"}]
    ids = policy_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    return RMRequest(uid=f"q{i}/0", prompt_ids=ids,
                     response_ids=policy_tok(answer, add_special_tokens=False)["input_ids"], raw_prompt=prompt,
                     group=f"q{i}")


def config(tiny_models, url: str, **settings) -> RMConfig:
    return RMConfig(endpoint=url, policy_tokenizer_path=str(tiny_models.policy), use_gpu=False, **settings)


async def scored(cfg: RMConfig, requests, deadline_s: float = 30.0):
    service = RemoteRMService(cfg, name="remote_test")
    await service.start()
    try:
        await service.begin_step()
        results = await asyncio.gather(*(service.score(r, deadline_s) for r in requests))
        return results, await service.end_step(), service
    finally:
        await service.close()


@pytest.mark.asyncio
async def test_a_generate_judge_is_asked_as_the_local_judge_renders_it_and_its_verdict_parsed(tiny_models, policy_tok):
    from verl_async_rm.scoring.judge import compile_prompt, judge_text
    from verl_async_rm.scoring.outcome import policy_side

    with ScriptedUpstream(chat=lambda p: Completion("The answer is right. Verdict: 7", completion_tokens=9)) as up:
        cfg = config(tiny_models, up.url, reward_kind="judge", judge_readout="generate", judge_max_tokens=64)
        results, figures, _ = await scored(cfg, [request(policy_tok, i) for i in range(3)])
    assert [r.score for r in results] == [7.0] * 3 and all(isinstance(r, Verdict) for r in results)
    chats = [s.body for s in up.seen if s.path == "/v1/chat/completions"]
    tokenizer, stop_ids, limit = policy_side(cfg)
    expected = judge_text(request(policy_tok, 0), template=compile_prompt(cfg.judge_prompt),
                          policy_tokenizer=tokenizer, response_stop_ids=stop_ids, id_limit=limit)
    assert expected in [c["messages"][0]["content"] for c in chats]  # the user turn the local judge renders
    assert all(c["model"] == "judge" and c["temperature"] == 0 and c["max_tokens"] == 64 for c in chats)
    assert figures["requests"] == figures["scored"] == 3 and figures["errors"] == 0
    assert figures["judge_tokens"] == 27 and figures["judge_reasks"] == 0 and figures["endpoint_requests"] == 3
    assert {"reward_tail_s", *REMOTE_FIGURES} - {"endpoint_latency_ms/p50", "endpoint_latency_ms/p99"} <= set(figures)


@pytest.mark.asyncio
async def test_a_verdict_that_does_not_parse_is_asked_again_then_fails_never_a_default(tiny_models, policy_tok):
    answers = iter(["no verdict here", "still none", "Verdict: 3", "nothing", "nothing", "nothing"])
    with ScriptedUpstream(chat=lambda p: next(answers)) as up:
        cfg = config(tiny_models, up.url, reward_kind="judge", judge_readout="generate", judge_retries=2)
        first, figures, _ = await scored(cfg, [request(policy_tok, 0)])
        second, again, _ = await scored(cfg, [request(policy_tok, 1)])
    assert first[0] == Verdict(3.0, "Verdict: 3") and figures["judge_reasks"] == 2 and figures["scored"] == 1
    assert isinstance(second[0], JudgeVerdictError) and "no match of judge_pattern" in str(second[0])
    assert second[0].reply == "nothing"
    assert again["judge_reasks"] == 2 and again["judge_parse_failures"] == 3 and again["errors"] == 1
    assert again["judge_calls"] == 3 and again["requests"] == 1
    # a re-ask is the same greedy conversation with the bad reply and why it did not read added
    chats = [s.body["messages"] for s in up.seen if s.path == "/v1/chat/completions"]
    assert [len(m) for m in chats[:3]] == [1, 3, 3] and chats[1][0] == chats[0][0]
    assert chats[1][1] == {"role": "assistant", "content": "no verdict here"} and chats[2][1]["content"] == "still none"
    assert chats[1][2]["content"].startswith("Your reply could not be read: no match of judge_pattern")
    assert "the verdict must match the regular expression" in chats[1][2]["content"]


def member(policy_tok, group: str, j: int, answer: str, size: int | None) -> RMRequest:
    prompt = [{"role": "user", "content": f"How many apples in {group}?"}]
    return RMRequest(uid=f"{group}/{j}", prompt_ids=policy_tok.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False),
        response_ids=policy_tok(answer, add_special_tokens=False)["input_ids"], raw_prompt=prompt, group=group,
        group_size=size)


def grade_by_label(payload) -> str:
    """A scripted group judge: each label gets the number its response states ("answer N" -> N)."""
    blocks = re.findall(r"^\[(\d+)\]\n(.*)$", payload["messages"][0]["content"], re.MULTILINE)
    return json.dumps({label: int(text.split()[-1]) for label, text in blocks})


@pytest.mark.asyncio
async def test_a_group_judge_makes_one_call_per_group_and_each_response_gets_its_labels_number(tiny_models,
                                                                                               policy_tok):
    from verl_async_rm.scoring.group_judge import member_labels, reply_schema

    groups = {f"uid-{g}": [member(policy_tok, f"uid-{g}", j, f"answer {10 * g + j}", 4) for j in range(4)]
              for g in range(3)}
    with ScriptedUpstream(chat=grade_by_label) as up:
        cfg = config(tiny_models, up.url, reward_kind="group_judge", judge_scale=10, judge_max_tokens=64)
        everyone = [m for ms in groups.values() for m in ms]
        results, figures, _ = await scored(cfg, everyone)
    assert [r.score for r in results] == [(10 * g + j) / 10 for g in range(3) for j in range(4)]
    chats = [s.body for s in up.seen if s.path == "/v1/chat/completions"]
    assert len(chats) == 3  # one call per group
    assert all(c["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "grades", "schema": reply_schema(4), "strict": True}} and c["temperature"] == 0 for c in chats)
    shuffled = 0
    for ms, result_group in zip(groups.values(), [results[i:i + 4] for i in range(0, 12, 4)], strict=True):
        from verl_async_rm.request import GroupRequest

        labels = member_labels(GroupRequest(ms[0].group, tuple(ms)), 0)
        assert [r.text.split("]")[0] for r in result_group] == [f"[{label}" for label in labels]
        shuffled += labels != (1, 2, 3, 4)
    assert shuffled >= 1
    assert (figures["requests"], figures["scored"], figures["groups_judged"], figures["judge_calls"]) == (12, 12, 3, 3)
    assert figures["groups_partial"] == 0 and figures["judge_tokens_out_per_trajectory"] > 0
    assert figures["judge_tokens_in_per_trajectory"] == figures["judge_tokens_in"] / 12


@pytest.mark.asyncio
async def test_a_group_whose_reply_does_not_read_is_asked_again_then_every_member_fails_with_the_reply(
        tiny_models, policy_tok):
    with ScriptedUpstream(chat=lambda p: '{"1": 5}') as up:
        cfg = config(tiny_models, up.url, reward_kind="group_judge", judge_retries=1)
        results, figures, _ = await scored(cfg, [member(policy_tok, "g", j, f"answer {j}", 3) for j in range(3)])
    chats = [s.body["messages"] for s in up.seen if s.path == "/v1/chat/completions"]
    assert len(chats) == 2 and chats[1][1] == {"role": "assistant", "content": '{"1": 5}'}
    assert chats[1][2]["content"].startswith("Your reply could not be read: labels 2, 3 are missing. Answer again;")
    assert all(isinstance(r, JudgeVerdictError) and r.reply == '{"1": 5}' and "labels 2, 3 are missing" in str(r)
               for r in results)
    assert (figures["errors"], figures["judge_reasks"], figures["judge_parse_failures"], figures["judge_calls"]) == \
        (3, 1, 2, 2)


@pytest.mark.asyncio
async def test_a_short_group_is_judged_with_the_responses_that_came_after_the_wait(tiny_models, policy_tok):
    with ScriptedUpstream(chat=grade_by_label) as up:
        cfg = config(tiny_models, up.url, reward_kind="group_judge", group_wait_s=0.2)
        results, figures, _ = await scored(cfg, [member(policy_tok, "g", j, f"answer {j + 4}", 3) for j in range(2)])
    assert [r.score for r in results] == [4.0, 5.0]
    [chat] = [s.body for s in up.seen if s.path == "/v1/chat/completions"]
    assert chat["response_format"]["json_schema"]["schema"]["required"] == ["1", "2"]
    assert (figures["groups_judged"], figures["groups_partial"], figures["scored"]) == (1, 1, 2)


@pytest.mark.asyncio
async def test_a_logits_judge_reads_the_first_judge_tokens_probability_among_them(tiny_models, policy_tok):
    top = {"Yes": -0.5, "Maybe": -0.7, "No": -1.5}
    with ScriptedUpstream(chat=lambda p: Completion("Yes", top_logprobs=[top])) as up:
        cfg = config(tiny_models, up.url, reward_kind="judge", judge_tokens=TOKENS)
        results, _, _ = await scored(cfg, [request(policy_tok, 0)])
    assert results[0] == pytest.approx(math.exp(-0.5) / (math.exp(-0.5) + math.exp(-1.5)), abs=1e-12)
    chat = next(s.body for s in up.seen if s.path == "/v1/chat/completions")
    assert chat["logprobs"] is True and chat["top_logprobs"] == 20 and chat["max_tokens"] == 1


@pytest.mark.asyncio
async def test_a_judge_token_missing_from_the_top_logprobs_fails_the_trajectory(tiny_models, policy_tok):
    with ScriptedUpstream(chat=lambda p: Completion("Yes", top_logprobs=[{"Yes": -0.1, "Sure": -2.0}])) as up:
        results, figures, _ = await scored(config(tiny_models, up.url, reward_kind="judge", judge_tokens=TOKENS),
                                           [request(policy_tok, 0)])
    assert isinstance(results[0], RewardModelError) and "do not hold judge_tokens ['No']" in str(results[0])
    assert figures["errors"] == 1


@pytest.mark.asyncio
async def test_an_outcome_rm_sends_the_local_paths_token_ids_and_reads_the_raw_score(tiny_models, policy_tok):
    from verl_async_rm.scoring.outcome import OutcomeKind

    seen_inputs = []

    def classify(item):
        seen_inputs.append(item)
        return [len(item) / 10.0]

    with ScriptedUpstream(classify=classify, models=("rm",)) as up:
        cfg = config(tiny_models, up.url, model_path=str(tiny_models.rm))
        reqs = [request(policy_tok, i) for i in range(2)]
        results, _, service = await scored(cfg, reqs)
    local = service_kind_ids(cfg, reqs)
    assert seen_inputs == local and results == [len(ids) / 10.0 for ids in local]
    assert all(s.body["use_activation"] is False for s in up.seen if s.path == "/classify")
    assert isinstance(OutcomeKind, type)


def service_kind_ids(cfg, reqs):
    """The ids the local outcome path builds for ``reqs`` (tokenizers only, no weights)."""
    from transformers import AutoConfig, AutoTokenizer

    from verl_async_rm.scoring.rm_config import kind_class

    text_config = AutoConfig.from_pretrained(cfg.model_path).get_text_config()
    kind = kind_class(cfg)(cfg, AutoTokenizer.from_pretrained(cfg.model_path), text_config, text_config.vocab_size)
    return [kind.build(r).ids for r in reqs]


@pytest.mark.asyncio
async def test_without_model_path_an_outcome_rm_sends_the_conversation(tiny_models, policy_tok):
    with ScriptedUpstream(classify=lambda item: [1.25, -3.0], models=("rm",)) as up:
        results, _, _ = await scored(config(tiny_models, up.url, score_index=1), [request(policy_tok, 0)])
    body = next(s.body for s in up.seen if s.path == "/classify")
    assert results == [-3.0] and body["messages"][-1] == {"role": "assistant", "content": "It is four."}


@pytest.mark.asyncio
async def test_with_a_fifth_of_the_requests_faulted_every_trajectory_is_scored_and_the_retries_show(
        tiny_models, policy_tok):
    def chat(payload):
        i = int(payload["messages"][0]["content"].split("2 + ")[1].split("?")[0])
        return f"Verdict: {i % 10}"

    schedule = FaultSchedule(rate=0.2, kinds=("rate_limit", "server_error", "unavailable", "drop", "truncate",
                                              "bad_json"), seed=5)
    with ScriptedUpstream(chat=chat) as up, FaultProxy(up.url, schedule) as proxy:
        cfg = config(tiny_models, proxy.url, reward_kind="judge", judge_readout="generate",
                     judge_prompt="Question: {{ prompt }} Answer: {{ response }}")
        results, figures, _ = await scored(cfg, [request(policy_tok, i) for i in range(50)])
    assert [r.score for r in results] == [float(i % 10) for i in range(50)]  # nothing lost, nothing defaulted
    injected = sum(1 for seen in proxy.seen if seen.fault and seen.path.endswith("/chat/completions"))
    assert injected >= 5 and figures["endpoint_retries"] == injected and figures["scored"] == 50
    assert figures["endpoint_requests"] == 50 + injected and figures["errors"] == 0


@pytest.mark.asyncio
async def test_past_its_deadline_a_trajectory_fails_with_the_endpoints_last_error(tiny_models, policy_tok):
    with ScriptedUpstream(chat=lambda p: Raw(503, {"error": {"message": "overloaded"}})) as up:
        cfg = config(tiny_models, up.url, reward_kind="judge", judge_readout="generate")
        results, figures, _ = await scored(cfg, [request(policy_tok, 0)], deadline_s=0.5)
    assert isinstance(results[0], RequestTimeoutError) and isinstance(results[0].__cause__, EndpointError)
    assert "503" in str(results[0].__cause__) and figures["errors"] == 1


@pytest.mark.asyncio
async def test_the_start_names_the_url_and_the_fix_for_a_missing_model_or_api(tiny_models):
    with ScriptedUpstream(models=("judge",)) as up:
        with pytest.raises(ValueError, match=rf"endpoint \['{up.url}'\] does not serve model 'other'.*Fix: set "
                                             "endpoint_model"):
            await probe(config(tiny_models, up.url, reward_kind="judge", endpoint_model="other"))
        assert await probe(config(tiny_models, up.url, reward_kind="judge")) == "judge"
    with ScriptedUpstream(classify=lambda item: Raw(404, {"detail": "Not Found"})) as up:
        with pytest.raises(ValueError, match=rf"endpoint {up.url} serves model 'judge' but not vLLM's "
                                             r"classification endpoint"):
            await probe(config(tiny_models, up.url))
    with pytest.raises(ValueError, match="could not list its models.*Fix: start the server"):
        await probe(config(tiny_models, "http://127.0.0.1:9/v1"), timeout_s=2.0)
