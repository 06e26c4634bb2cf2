"""Judge RMs on real parts: a ``generate`` judge on real vLLM (its CPU build) in an RM service, and both readouts next
to an outcome RM on verl's v1 trainer through the plugin's manager.

The ``generate`` judge is the tiny ``digit`` judge (``verl_async_rm.testing.judges``): greedy, it counts up from a
first digit fixed by the judge input's last token, by a margin no numerical path can flip, so the references
(transformers' greedy ``generate`` of the same judge prompt, rendered here with plain Jinja) are exact, and a pattern
that accepts only a first digit of 0-4 makes some verdicts unparseable on purpose. The ``logits`` judge is the tiny random ``lm`` judge, compared
with a plain transformers forward (fp32, 1e-4).

These tests skip with the reason where vLLM cannot run; ``VERL_ASYNC_RM_REQUIRE_VLLM=1`` (set by ``.ci/run``) turns
that skip into a failure.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from conftest import require_vllm
from judge_cases import DIGIT_PROMPT, TOKENS, generate_reference, judge_ids, logits_reference, response_text
from manager_cases import RM_W, RULE_W, running_manager
from rm_cases import direct_score, hf_model, make_request, score_all

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.errors import JudgeVerdictError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.judge import DEFAULT_PROMPTS, Verdict
from verl_async_rm.service.service import start_rm_service

pytestmark = pytest.mark.integration

ATOL = 1e-4
HANG_S = 180.0
MAX_TOKENS = 4
JUDGE_W, GRADE_W = 0.5, -0.25
N = 2  # rollout.n
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


def judges(tiny_judges) -> list[str]:
    return [
        f"+async_rm.models.judge.model_path={tiny_judges.lm}", "+async_rm.models.judge.reward_kind=judge",
        f"+async_rm.models.judge.weight={JUDGE_W}", "+async_rm.models.judge.n_gpus_per_node=1",
        f"+async_rm.models.judge.judge_tokens=[\"{TOKENS[0]}\",\"{TOKENS[1]}\"]",
        f"+async_rm.models.grade.model_path={tiny_judges.digit}", "+async_rm.models.grade.reward_kind=judge",
        "+async_rm.models.grade.judge_readout=generate", f"+async_rm.models.grade.judge_prompt='{DIGIT_PROMPT}'",
        "+async_rm.models.grade.judge_pattern='^([0-9])'", f"+async_rm.models.grade.judge_max_tokens={MAX_TOKENS}",
        f"+async_rm.models.grade.weight={GRADE_W}", "+async_rm.models.grade.n_gpus_per_node=1",
    ]


def test_both_readouts_next_to_an_outcome_rm_on_the_v1_trainer(ray_local, vllm_required, tiny_models, tiny_judges,
                                                                 policy_tok, digit_judge):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    questions = ["how many apples does the farmer have", "what is the total cost of two books", "how many eggs"]
    with running_manager(ray_local, tiny_models, "v1", *judges(tiny_judges)) as (manager, config):
        fit = V1FitLoop(config, manager)
        prompts = prompt_batch(questions, ground_truth="42")
        asked = dict(zip(prompts["uid"], questions, strict=True))
        batch = fit.train_step(prompts)
        assert set(manager.rm_services) == {"main", "judge", "grade"}
    main_rm = hf_model(tiny_models.rm)
    lm = AutoModelForCausalLM.from_pretrained(tiny_judges.lm, dtype=torch.float32).eval()
    lm_tok = AutoTokenizer.from_pretrained(tiny_judges.lm)
    digit, digit_tok = digit_judge
    assert len(batch.keys) == len(questions) * N
    judged = []
    for i in range(len(batch.keys)):
        info, response = batch.reward_extra_info(i), batch.data["responses"][i]
        question, text = asked[batch.data["uid"][i]], response_text(policy_tok, response)
        main = direct_score(main_rm, torch.cat([batch.data["prompts"][i], response]).tolist())
        judge = logits_reference(lm, lm_tok, judge_ids(lm_tok, DEFAULT_PROMPTS["logits"], question, text, "42"))
        verdict_text, grade = generate_reference(digit, digit_tok, judge_ids(digit_tok, DIGIT_PROMPT, question, text),
                                                 MAX_TOKENS, "^([0-9])")
        rule = (len(policy_tok.decode(response, skip_special_tokens=True)) % 7) / 7.0
        assert info["rm_score_main"] == pytest.approx(main, abs=ATOL)
        assert info["rm_score_judge"] == pytest.approx(judge, abs=ATOL)
        assert info["rm_score_grade"] == grade and info["rm_verdict_grade"] == verdict_text
        assert batch.reward(i) == pytest.approx(RM_W * main + JUDGE_W * judge + GRADE_W * grade + RULE_W * rule,
                                                abs=ATOL)
        judged.append(judge)
    assert max(judged) - min(judged) > 5 * ATOL
    m = batch.metrics
    assert m["async_rm/scored"] == len(batch.keys) and m["async_rm/errors"] == 0
    assert m["async_rm/grade/judge_parse_failures"] == 0 and m["async_rm/grade/judge_tokens"] >= len(batch.keys)
    assert "async_rm/judge/judge_tokens" not in m  # a logits judge writes nothing
