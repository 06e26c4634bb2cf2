"""``gpus_per_replica=2`` on vLLM: each replica runs one engine, tensor parallel over the two CPUs of its bundle (vLLM's
CPU build, one core per rank), its ranks processes of the replica's actor.

Real parts throughout, and few engine starts (CI time): one manager for the module, its one step of the v1 agent loop
with both judge readouts next to a tensor-parallel outcome RM: the tiny RM on a two-rank vLLM pooling engine (within
1e-4 of transformers), a ``generate`` judge on a one-rank vLLM engine (its verdicts equal transformers' greedy
``generate`` of the same prompt; the engine takes its k ranks the same way whichever runner it has) and a ``logits``
judge on transformers (the tiny random ``lm`` judge, within 1e-4 of a plain forward), every reward exact; then the main
RM's service called directly (many requests, then a rank killed under load, and its replacement). That step runs on the
stubbed fit loop the judge tests use (:class:`~verl_async_rm.testing.v1.V1FitLoop`: verl's v1 agent-loop manager,
workers and reward path through the plugin's manager, without verl's rollout engine and actor update), not on verl's
real trainer: a vLLM rollout and an FSDP actor next to tensor-parallel engines are too heavy for a 2-core CI machine.

The judge is the tiny ``digit`` judge (``verl_async_rm.testing.judges``), whose greedy verdicts no numerical path can
flip, so they are compared exactly with transformers' greedy ``generate`` of the same prompt.

These tests skip with the reason where vLLM cannot run; ``VERL_ASYNC_RM_REQUIRE_VLLM=1`` turns that into a failure.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from conftest import require_vllm
from judge_cases import DIGIT_PROMPT, TOKENS, generate_reference, judge_ids, logits_reference, response_text
from manager_cases import RM_W, RULE_W, running_manager
from rm_cases import direct_score, hf_model, make_request, score_all, wait_stats

from verl_async_rm.scoring.judge import DEFAULT_PROMPTS
from verl_async_rm.service.client import score_with_timeout

pytestmark = pytest.mark.integration

ATOL = 1e-4
HANG_S = 300.0
MAX_TOKENS = 11  # the digit judge's longest reply: ten digits and its end
JUDGE_W, GRADE_W = 0.5, -0.25
TP = 2
ANSWERS = ["the farmer has 7 apples", "it costs 12 dollars", "five plus two is seven", "no", "half of ten is five",
           "the total is 30 pens", "she bought eggs", "two trains", "answer 9", "we saved money"]


@pytest.fixture(scope="module")
def vllm_required():
    require_vllm()


def requests(policy_tok, n: int, tag: str):
    return [make_request(policy_tok, f"question {i % 4}", ANSWERS[i % len(ANSWERS)], uid=f"{tag}{i}",
                         group=f"{tag}{i % 4}") for i in range(n)]


def ranks_of(info) -> list:
    """The engine's rank processes: the replica actor's children that vLLM named ``Worker_TP<r>``."""
    import psutil

    children = psutil.Process(info["pid"]).children(recursive=True)
    return [p for p in children if "Worker_TP" in " ".join(p.cmdline()) + p.name()]


QUESTIONS = ["how many apples does the farmer have", "what is the total cost of two books", "how many eggs"]
#: The main RM: the tiny RM on a two-rank vLLM pooling engine (one replica).
MAIN = ["+async_rm.engine=vllm", f"reward.reward_model.n_gpus_per_node={TP}", f"+async_rm.gpus_per_replica={TP}",
        "+async_rm.init_timeout_s=240"]
#: The ``logits`` judge: the tiny random ``lm`` judge on transformers (the top-level engine and size are the main RM's;
#: its ``model_path`` is set by the fixture).
JUDGE = ["+async_rm.models.judge.reward_kind=judge",
         f"+async_rm.models.judge.weight={JUDGE_W}", "+async_rm.models.judge.n_gpus_per_node=1",
         "+async_rm.models.judge.engine=transformers", "+async_rm.models.judge.gpus_per_replica=1",
         f"+async_rm.models.judge.judge_tokens=[\"{TOKENS[0]}\",\"{TOKENS[1]}\"]"]
#: The ``generate`` judge: the tiny ``digit`` judge on a one-rank vLLM engine (its ``model_path`` set by the fixture).
#: Its prompt ends after the response (a response the rollout ends in the digit 9 would leave it nothing to write).
GRADE_PROMPT = DIGIT_PROMPT + " ->"
GRADE = ["+async_rm.models.grade.reward_kind=judge",
         "+async_rm.models.grade.judge_readout=generate", f"+async_rm.models.grade.judge_prompt='{GRADE_PROMPT}'",
         "+async_rm.models.grade.judge_pattern='^([0-9])'", f"+async_rm.models.grade.judge_max_tokens={MAX_TOKENS}",
         f"+async_rm.models.grade.weight={GRADE_W}", "+async_rm.models.grade.n_gpus_per_node=1",
         "+async_rm.models.grade.gpus_per_replica=1"]


@pytest.fixture(scope="module")
def run(ray_local, vllm_required, tiny_models, tiny_judges):
    """The module's manager and its one v1 step: ``(manager, prompts, batch)``; the manager stays up for the module's
    other tests, which call its main RM's service directly."""
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    extra = [*MAIN, *JUDGE, f"+async_rm.models.judge.model_path={tiny_judges.lm}", *GRADE,
             f"+async_rm.models.grade.model_path={tiny_judges.digit}"]
    with running_manager(ray_local, tiny_models, "v1", *extra) as (manager, config):
        prompts = prompt_batch(QUESTIONS, ground_truth="42")
        yield manager, prompts, V1FitLoop(config, manager).train_step(prompts)


def test_one_v1_step_with_both_judge_readouts_next_to_a_tensor_parallel_outcome_rm(run, tiny_models, tiny_judges,
                                                                                   policy_tok):
    """Every reward exact: the two-rank vLLM outcome RM within 1e-4 of a plain transformers forward, the ``logits``
    judge within 1e-4 of a plain forward of its judge prompt, the ``generate`` judge's verdict and text as
    transformers' greedy ``generate`` of the same prompt, the rule, and their weighted sum."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manager, prompts, batch = run
    assert set(manager.rm_services) == {"main", "judge", "grade"}
    described = {name: ray.get(service.describe.remote(), timeout=60) for name, service in manager.rm_services.items()}
    assert [(info["tensor_parallel_size"], info["judge_readout"]) for info in described["grade"]] == [(1, "generate")]
    [info] = described["main"]
    assert info["engine"] == "vllm" and info["tensor_parallel_size"] == TP and info["gpus_per_replica"] == TP
    assert "load-time check inputs as transformers within" in info["engine_reason"]
    assert len(ranks_of(info)) == TP  # the ranks are the replica's own processes
    assert [info["engine"] for info in described["judge"]] == ["transformers"]
    asked = dict(zip(prompts["uid"], QUESTIONS, strict=True))
    main_rm = hf_model(tiny_models.rm)
    lm = AutoModelForCausalLM.from_pretrained(tiny_judges.lm, dtype=torch.float32).eval()
    lm_tok = AutoTokenizer.from_pretrained(tiny_judges.lm)
    digit = AutoModelForCausalLM.from_pretrained(tiny_judges.digit, dtype=torch.float32).eval()
    digit_tok = AutoTokenizer.from_pretrained(tiny_judges.digit)
    assert len(batch.keys) == len(QUESTIONS) * 2
    judged = []
    for i in range(len(batch.keys)):
        info, response = batch.reward_extra_info(i), batch.data["responses"][i]
        question, text = asked[batch.data["uid"][i]], response_text(policy_tok, response)
        main = direct_score(main_rm, torch.cat([batch.data["prompts"][i], response]).tolist())
        logits = logits_reference(lm, lm_tok, judge_ids(lm_tok, DEFAULT_PROMPTS["logits"], question, text, "42"))
        verdict_text, verdict = generate_reference(
            digit, digit_tok, judge_ids(digit_tok, GRADE_PROMPT, question, text), MAX_TOKENS, "^([0-9])")
        rule = (len(policy_tok.decode(response, skip_special_tokens=True)) % 7) / 7.0
        assert info["rm_score_main"] == pytest.approx(main, abs=ATOL)
        assert info["rm_score_judge"] == pytest.approx(logits, abs=ATOL)
        assert info["rm_score_grade"] == verdict and info["rm_verdict_grade"] == verdict_text
        assert batch.reward(i) == pytest.approx(
            RM_W * main + JUDGE_W * logits + GRADE_W * verdict + RULE_W * rule, abs=ATOL)
        judged.append(logits)
    assert max(judged) - min(judged) > 5 * ATOL  # the logits judge's scores differ: the comparison means something
    m = batch.metrics
    assert m["async_rm/scored"] == len(batch.keys) and m["async_rm/errors"] == 0
    assert m["async_rm/grade/judge_parse_failures"] == 0 and m["async_rm/grade/judge_tokens"] >= len(batch.keys)
    assert "async_rm/judge/judge_tokens" not in m  # a logits judge writes nothing


def test_a_tensor_parallel_pooling_rm_scores_as_transformers(run, tiny_models, policy_tok):
    """The main RM's service called directly, many requests at once: every score as transformers'."""
    service = run[0].rm_services["main"]
    reqs = requests(policy_tok, 24, "a")
    results = score_all(service, reqs, HANG_S)
    model = hf_model(tiny_models.rm)
    assert results == pytest.approx([direct_score(model, r.prompt_ids + r.response_ids) for r in reqs], abs=ATOL)


def test_a_rank_killed_under_load_ends_its_replica_which_is_replaced_and_nothing_is_lost(run, tiny_models,
                                                                                      policy_tok):
    """The main RM's service, last: one rank of its only replica is killed while requests are submitted; the
    replica ends, its batch is re-queued, a new two-rank replica loads and scores every request."""
    service = run[0].rm_services["main"]
    reqs = requests(policy_tok, 24, "k")

    async def main():
        before = await service.stats.remote()
        [info] = await service.describe.remote()
        waiting = [asyncio.ensure_future(score_with_timeout(service, r, timeout_s=HANG_S)) for r in reqs]
        ranks_of(info)[-1].kill()
        scores = await asyncio.gather(*waiting)
        replaced = await wait_stats(service, lambda s: s["replicas_replaced_total"] > before["replicas_replaced_total"],
                                    "the replica replaced", timeout_s=HANG_S)
        return before, info, scores, replaced, await service.describe.remote()

    before, old, scores, replaced, [new] = asyncio.run(main())
    model = hf_model(tiny_models.rm)
    assert scores == pytest.approx([direct_score(model, r.prompt_ids + r.response_ids) for r in reqs], abs=ATOL)
    assert replaced["replicas_lost_total"] == before["replicas_lost_total"] + 1
    assert replaced["failed"] == before["failed"]
    assert new["pid"] != old["pid"] and new["tensor_parallel_size"] == TP and len(ranks_of(new)) == TP
