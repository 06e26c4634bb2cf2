"""Remote RMs against vLLM's own OpenAI-compatible server (its CPU build, on 127.0.0.1), scored as the local path
scores the same checkpoint:

- the tiny ``digit`` judge (``testing/judges.py``), served once for the module: read at its first token (chat
  completions with ``top_logprobs``) its score equals the local transformers readout within 1e-3; writing its verdict
  (greedy, temperature 0) its text and verdict equal transformers' greedy ``generate`` of the local input ids;
- the tiny sequence-classification RM (vLLM's ``/classify``, raw outputs) at the vLLM server of verl's own served RM:
  ``test_real_vllm.py`` (one vLLM server fewer here);
- with a fifth of the requests faulted by the fault proxy (429 with ``Retry-After``, 500, 503, dropped connections,
  cut and non-JSON bodies; a real HTTP server in front of the real one) every trajectory gets exactly the score it
  gets without faults, and the retries show in the step's figures;
- through Ray: the RM service actor ``start_rm_service`` starts for a remote RM (nothing placed) and the workers' one
  call, ``score_with_timeout``, gets the same scores.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import require_vllm
from rm_cases import remote_scores

from verl_async_rm.errors import RequestTimeoutError
from verl_async_rm.request import RMRequest, Verdict
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.testing.fault_proxy import FaultProxy, FaultSchedule
from verl_async_rm.testing.judges import LOGITS_TOKENS

pytestmark = pytest.mark.integration

PROMPT = "Question: {{ prompt }}\nAnswer: {{ response }}"  # ends with the response: each trajectory reads its own
ANSWERS = ["four", "It is 4.", "2 + 2 = 4", "five, I think", "Let me see: 2 and 2 make 4", "22", "no idea", "4"]
HANG_S = 120.0


@pytest.fixture(scope="module")
def judge_server(tiny_judges, tmp_path_factory):
    require_vllm()
    from verl_async_rm.testing.vllm_server import start_vllm_server

    with start_vllm_server(tiny_judges.digit, name="judge", log_dir=tmp_path_factory.mktemp("vllm")) as server:
        yield server


def trajectories(policy_tok, n: int = len(ANSWERS)) -> list[RMRequest]:
    out = []
    for i in range(n):
        prompt = [{"role": "user", "content": f"What is 2 + 2? (try {i})"}]
        out.append(RMRequest(
            uid=f"q{i}/0", raw_prompt=prompt,
            prompt_ids=policy_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False),
            response_ids=policy_tok(ANSWERS[i % len(ANSWERS)], add_special_tokens=False)["input_ids"]))
    return out


def judge_config(tiny_models, tiny_judges, url: str | None, **settings) -> RMConfig:
    return RMConfig(model_path=str(tiny_judges.digit), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                    reward_kind="judge", judge_prompt=PROMPT, endpoint=url, **settings)


def test_a_logits_judge_at_the_endpoint_scores_as_the_local_readout(judge_server, tiny_models, tiny_judges,
                                                                    policy_tok):
    from verl_async_rm.scoring.scorer import RewardModelScorer

    requests = trajectories(policy_tok)
    local = RewardModelScorer(judge_config(tiny_models, tiny_judges, None, judge_tokens=LOGITS_TOKENS)).score(requests)
    remote, figures = remote_scores(judge_config(tiny_models, tiny_judges, judge_server.url,
                                                 judge_tokens=LOGITS_TOKENS), requests)
    assert remote == pytest.approx(local, abs=1e-3)
    assert max(local) - min(local) > 0.05  # the trajectories are told apart: the comparison means something
    assert figures["scored"] == len(requests) and figures["errors"] == 0 and figures["endpoint_tokens_in"] > 0


def test_a_generate_judge_at_the_endpoint_writes_what_transformers_greedy_writes(judge_server, tiny_models,
                                                                                tiny_judges, policy_tok):
    """Each verdict is what the plugin reads from transformers' greedy ``generate`` of the same judge prompt (the
    reading a local ``generate`` judge on vLLM does too: ``JudgeGenerateKind.read``); the pattern accepts only a
    first digit of 0-4, so some replies do not read, and each of those fails its own trajectory alone, naming it and
    quoting the reply, and is counted."""
    from transformers import AutoModelForCausalLM

    from verl_async_rm.errors import JudgeVerdictError
    from verl_async_rm.scoring.engine import Generated
    from verl_async_rm.scoring.judge import JudgeGenerateKind
    from verl_async_rm.scoring.rm_config import kind_class

    config = judge_config(tiny_models, tiny_judges, None, judge_readout="generate", judge_max_tokens=11,
                          judge_pattern="^([0-4])")
    requests = trajectories(policy_tok)
    from transformers import AutoConfig, AutoTokenizer

    text_config = AutoConfig.from_pretrained(tiny_judges.digit)
    kind = kind_class(config)(config, AutoTokenizer.from_pretrained(tiny_judges.digit), text_config,
                              text_config.vocab_size)
    assert isinstance(kind, JudgeGenerateKind)
    model = AutoModelForCausalLM.from_pretrained(tiny_judges.digit, dtype=torch.float32).eval()
    expected = []
    for request in requests:
        ids = kind.build(request).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=11, do_sample=False)
        written = out[0, len(ids):].tolist()
        ended = kind.rm_tokenizer.eos_token_id in written
        text = kind.rm_tokenizer.decode(written, skip_special_tokens=True)
        expected.append(kind.read(request, Generated(text, len(written), "stop" if ended else "length"), None))
    remote, figures = remote_scores(judge_config(tiny_models, tiny_judges, judge_server.url,
                                                 judge_readout="generate", judge_max_tokens=11,
                                                 judge_pattern="^([0-4])"), requests)
    assert {isinstance(v, Verdict) for v in expected} == {True, False}  # both kinds are in the batch
    for request, got, want in zip(requests, remote, expected, strict=True):
        if isinstance(want, Verdict):
            assert got == want, request.uid
        else:
            assert isinstance(got, JudgeVerdictError), (request.uid, got)
            # the same trajectory, reason and reply's end (the judge is named by its endpoint there)
            assert isinstance(want, JudgeVerdictError) and f"trajectory {request.uid}: " in str(got)
            assert str(got).split("trajectory ", 1)[1] == str(want).split("trajectory ", 1)[1], request.uid
    failed = sum(not isinstance(v, Verdict) for v in expected)
    assert (figures["judge_parse_failures"], figures["errors"], figures["scored"]) == \
        (failed, failed, len(requests) - failed)


def test_with_a_fifth_of_the_requests_faulted_nothing_is_lost_or_defaulted(judge_server, tiny_models, tiny_judges,
                                                                           policy_tok):
    requests = trajectories(policy_tok, 40)
    config = judge_config(tiny_models, tiny_judges, judge_server.url, judge_tokens=LOGITS_TOKENS)
    clean, _ = remote_scores(config, requests)
    schedule = FaultSchedule(plan={0: None}, rate=0.2, seed=3, kinds=(
        "rate_limit", "server_error", "unavailable", "drop", "truncate", "bad_json"), retry_after="0.2")
    with FaultProxy(judge_server.url, schedule) as proxy:
        faulted, figures = remote_scores(judge_config(tiny_models, tiny_judges, proxy.url,
                                                      judge_tokens=LOGITS_TOKENS), requests)
    injected = sum(1 for seen in proxy.seen if seen.fault)
    assert faulted == clean  # every trajectory: exactly its score, none lost, none defaulted
    assert injected >= 4 and figures["endpoint_retries"] == injected and figures["endpoint_429s"] >= 1
    assert figures["scored"] == len(requests) and figures["errors"] == 0


def test_an_answer_past_the_deadline_fails_its_trajectory_on_time(judge_server, tiny_models, tiny_judges,
                                                                  policy_tok):
    schedule = FaultSchedule(plan={1: "delay"}, delay_s=30.0)
    with FaultProxy(judge_server.url, schedule) as proxy:
        results, figures = remote_scores(
            judge_config(tiny_models, tiny_judges, proxy.url, judge_tokens=LOGITS_TOKENS),
            trajectories(policy_tok, 1), deadline_s=2.0)
    assert isinstance(results[0], RequestTimeoutError) and figures["errors"] == 1


def test_the_rm_service_actor_serves_a_remote_rm_with_nothing_placed(ray_local, judge_server, tiny_models,
                                                                    tiny_judges, policy_tok):
    import ray

    from verl_async_rm.service.batching import BatchPolicy
    from verl_async_rm.service.client import score_with_timeout
    from verl_async_rm.service.service import start_rm_service

    config = judge_config(tiny_models, tiny_judges, judge_server.url, judge_tokens=LOGITS_TOKENS)
    requests = trajectories(policy_tok)
    before = ray.available_resources()
    service = start_rm_service(config, BatchPolicy(), name="remote_actor")
    try:
        placed = ray.available_resources()

        async def main():
            await service.begin_step.remote(len(requests))
            results = await asyncio.gather(*(score_with_timeout(service, r, timeout_s=HANG_S) for r in requests))
            return results, await service.end_step.remote(), await service.describe.remote()

        results, figures, described = asyncio.run(main())
    finally:
        ray.get(service.close.remote(), timeout=60)
        ray.kill(service)
    direct, _ = remote_scores(config, requests)
    assert results == pytest.approx(direct, abs=1e-6) and figures["scored"] == len(requests)
    assert placed.get("CPU") == before.get("CPU")  # no replica, no pool
    assert described[0]["endpoint"] == [judge_server.url] and described[0]["model"] == "judge"
