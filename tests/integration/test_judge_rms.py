"""A ``generate`` judge on real vLLM (its CPU build) in an RM service: its verdicts as transformers' greedy
``generate``, an unparseable one failing alone. Both readouts next to an outcome RM through the plugin's v1 manager:
``test_tp_replicas.py`` (the ``generate`` judge there tensor parallel).

The ``generate`` judge is the tiny ``digit`` judge (``verl_async_rm.testing.judges``): greedy, it counts up from a
first digit fixed by the judge input's last token, by a margin no numerical path can flip, so the references
(transformers' greedy ``generate`` of the same judge prompt, rendered here with plain Jinja) are exact, and a pattern
that accepts only a first digit of 0-4 makes some verdicts unparseable on purpose.

These tests skip with the reason where vLLM cannot run; ``VERL_ASYNC_RM_REQUIRE_VLLM=1`` (set by ``.ci/run``) turns
that skip into a failure.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from conftest import require_vllm
from judge_cases import DIGIT_PROMPT, generate_reference, judge_ids, response_text
from rm_cases import make_request, score_all

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.errors import JudgeVerdictError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.judge import Verdict
from verl_async_rm.service.service import start_rm_service

pytestmark = pytest.mark.integration

ATOL = 1e-4
HANG_S = 180.0
MAX_TOKENS = 4
ANSWERS = ["the farmer has 7 apples", "it costs 12 dollars", "five plus two is seven", "no", "half of ten is five",
           "the total is 30 pens", "she bought eggs", "two trains", "answer 9", "we saved money"]


@pytest.fixture(scope="module")
def vllm_required():
    require_vllm()


@pytest.fixture(scope="module")
def digit_judge(tiny_judges):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_judges.digit, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_judges.digit))


@pytest.fixture(scope="module")
def grade_service(ray_local, vllm_required, tiny_models, tiny_judges):
    config = RMConfig(model_path=str(tiny_judges.digit), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      reward_kind="judge", judge_readout="generate", judge_prompt=DIGIT_PROMPT,
                      judge_pattern="^([0-4])", judge_max_tokens=MAX_TOKENS, n_gpus_per_node=1, nnodes=1,
                      placement_timeout_s=60, init_timeout_s=180)
    service = start_rm_service(config, BatchPolicy(max_batch_size=16, max_wait_ms=20),
                               name=f"judge_generate_{time.monotonic_ns()}")
    yield service
    ray.get(service.close.remote(), timeout=HANG_S)
    ray.kill(service)


def test_a_generate_judge_on_vllm_parses_its_verdicts_and_an_unparseable_one_fails_alone(
        grade_service, digit_judge, policy_tok):
    requests = [make_request(policy_tok, f"question {i}", answer, uid=f"v{i}", group=f"g{i // 2}")
                for i, answer in enumerate(ANSWERS)]
    ray.get(grade_service.end_step.remote(), timeout=HANG_S)  # the step counters start here
    results = score_all(grade_service, requests, HANG_S)
    model, judge_tok = digit_judge
    expected = [generate_reference(model, judge_tok, judge_ids(judge_tok, DIGIT_PROMPT, f"question {i}", response_text(
        policy_tok, r.response_ids)), MAX_TOKENS, "^([0-4])") for i, r in enumerate(requests)]
    assert {v is None for _, v in expected} == {True, False}  # both kinds are in the batch
    for request, result, (text, verdict) in zip(requests, results, expected, strict=True):
        if verdict is None:
            assert isinstance(result, JudgeVerdictError), (request.uid, result)
            assert f"trajectory {request.uid}" in str(result) and repr(text[-200:]) in str(result)
        else:
            assert result == Verdict(verdict, text), request.uid
    step = ray.get(grade_service.end_step.remote(), timeout=HANG_S)
    assert step["judge_tokens"] == MAX_TOKENS * len(requests)  # the judge counts up to max_tokens digits
    assert step["judge_parse_failures"] == step["rm_failed_items"] == sum(v is None for _, v in expected)
    info = ray.get(grade_service.describe.remote(), timeout=60)[0]
    assert info["engine"] == "vllm" and info["judge_readout"] == "generate" and info["packing"] == "vllm"
