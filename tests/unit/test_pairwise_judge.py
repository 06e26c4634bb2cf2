"""The pairwise judge (``reward_kind='pairwise_judge'``) end to end in this process (no Ray): its kind on a local
transformers forward (the logits readout, P(A wins) as a plain forward's softmax over the two judge tokens), and its RM
service (``RMService``, the actor's class) at a scripted OpenAI-compatible server (a stand-in whose answers the test
controls: it prefers the response that states the larger number), where a group's comparisons are asked in both
orders through the service's batcher and turned into rewards: win rates and Bradley-Terry scores as computed by hand,
a judge that always prefers the first position gaining nothing, failed comparisons leaving the rest, a partial group,
a cut or unreadable reply asked again, the metrics. The math alone: ``test_pairwise.py``; on vLLM in verl's trainer:
``tests/integration/test_cpu_recipe_v0.py``."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest

from verl_async_rm.errors import ConfigValueError, JudgeVerdictError, RewardModelError
from verl_async_rm.request import GroupRequest, RMRequest, Verdict
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.service import RMService
from verl_async_rm.testing.fault_proxy import Completion, Raw, ScriptedUpstream

pytestmark = pytest.mark.unit


def member(policy_tok, group: str, j: int, answer: str, size: int | None = 4) -> RMRequest:
    prompt = [{"role": "user", "content": f"How many apples in {group}?"}]
    return RMRequest(uid=f"{group}/{j}", prompt_ids=policy_tok.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False),
        response_ids=policy_tok(answer, add_special_tokens=False)["input_ids"], raw_prompt=prompt, group=group,
        group_size=size)


def stated(text: str) -> int:
    return int(re.search(r"answer (\d+)", text).group(1))


def larger_wins(payload) -> str:
    """A scripted pairwise judge: the response stating the larger number wins, equal numbers tie."""
    content = payload["messages"][0]["content"]
    a = stated(content.split("<response_a>")[1])
    b = stated(content.split("<response_b>")[1])
    return json.dumps({"winner": "A" if a > b else "B" if b > a else "tie"})


def config(tiny_models, url: str, **settings) -> RMConfig:
    return RMConfig(endpoint=url, policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                    reward_kind="pairwise_judge", judge_readout="generate", judge_max_tokens=16, **settings)


async def scored(cfg: RMConfig, requests, deadline_s: float = 30.0):
    service = RMService(cfg, BatchPolicy(max_wait_ms=1), name="pairwise_test")
    await service.start()
    try:
        await service.begin_step()
        results = await asyncio.gather(*(service.score(r, deadline_s) for r in requests))
        return results, await service.end_step()
    finally:
        await service.close()


@pytest.mark.asyncio
async def test_a_group_is_compared_in_both_orders_and_each_response_gets_its_win_rate(tiny_models, policy_tok):
    numbers = [5, 9, 5, 1]  # responses 0 and 2 tie
    group = [member(policy_tok, "g", j, f"answer {n}") for j, n in enumerate(numbers)]
    with ScriptedUpstream(chat=larger_wins) as up:
        results, metrics = await scored(config(tiny_models, up.url), group)
        chats = [s.body for s in up.seen if s.path == "/v1/chat/completions"]
    # by hand: 9 beats all three (1.0); each 5 beats 1 and ties the other 5 (1.5 / 3); 1 loses all (0.0)
    assert [r.score for r in results] == pytest.approx([0.5, 1.0, 0.5, 0.0])
    assert all(isinstance(r, Verdict) and r.text.startswith("win_rate") for r in results)
    assert len(chats) == 12  # 6 pairs, each in both orders
    shown = {(stated(c["messages"][0]["content"].split("<response_a>")[1]),
              stated(c["messages"][0]["content"].split("<response_b>")[1])) for c in chats}
    assert {(9, 1), (1, 9), (5, 9), (9, 5)} <= shown
    assert chats[0]["response_format"]["json_schema"]["schema"]["properties"]["winner"]["enum"] == ["A", "B", "tie"]
    assert (metrics["comparisons"], metrics["comparisons_per_trajectory"], metrics["pairwise_ties"]) == (12, 3, 2)
    assert metrics["position_flip_rate"] == 0.0 and metrics["intransitive_rate"] == 0.0
    assert (metrics["requests"], metrics["scored"], metrics["groups_judged"]) == (4, 4, 1)


@pytest.mark.asyncio
async def test_bradley_terry_scores_a_group_as_computed_by_hand(tiny_models, policy_tok):
    from verl_async_rm.scoring.pairwise import bradley_terry

    group = [member(policy_tok, "h", j, f"answer {n}", 3) for j, n in enumerate([3, 7, 5])]
    with ScriptedUpstream(chat=larger_wins) as up:
        results, _ = await scored(config(tiny_models, up.url, pair_aggregate="bradley_terry"), group)
    # the strict order 7 > 5 > 3: the strongest 1, the weakest 0, the middle one halfway on the log scale (symmetric)
    assert [r.score for r in results] == pytest.approx([0.0, 1.0, 0.5], abs=1e-9)
    assert bradley_terry(3, {(0, 1): 0.0, (0, 2): 0.0, (1, 2): 1.0}) == pytest.approx([0.0, 1.0, 0.5], abs=1e-9)


@pytest.mark.asyncio
async def test_a_judge_that_always_prefers_the_first_position_gains_nothing(tiny_models, policy_tok):
    group = [member(policy_tok, "f", j, f"answer {n}") for j, n in enumerate([1, 2, 3, 4])]
    with ScriptedUpstream(chat=lambda p: '{"winner": "A"}') as up:
        results, metrics = await scored(config(tiny_models, up.url), group)
    assert [r.score for r in results] == [0.5] * 4 and metrics["position_flip_rate"] == 1.0


@pytest.mark.asyncio
async def test_a_failed_comparison_leaves_the_others_and_a_response_with_none_fails_alone(tiny_models, policy_tok):
    def refuses_99(payload):
        if "answer 99" in payload["messages"][0]["content"]:
            return Raw(400, {"error": {"message": "content refused"}})
        return larger_wins(payload)

    group = [member(policy_tok, "r", j, f"answer {n}", 3) for j, n in enumerate([4, 99, 6])]
    with ScriptedUpstream(chat=refuses_99) as up:
        results, metrics = await scored(config(tiny_models, up.url), group)
    assert [r.score for r in results[::2]] == [0.0, 1.0]  # 4 and 6 compared with each other only
    assert isinstance(results[1], RewardModelError) and "none of its pairs" in str(results[1])
    assert "content refused" in str(results[1])
    assert (metrics["comparisons"], metrics["comparisons_failed"], metrics["errors"]) == (6, 4, 1)


@pytest.mark.asyncio
async def test_a_response_with_no_comparison_answered_is_told_its_own_comparisons_error(tiny_models, policy_tok):
    def refuses(payload):
        content = payload["messages"][0]["content"]
        if "answer 99" in content:
            return Raw(400, {"error": {"message": "content refused"}})
        return Raw(400, {"error": {"message": "pair too long"}})

    group = [member(policy_tok, "e", j, f"answer {n}", 3) for j, n in enumerate([4, 6, 99])]
    with ScriptedUpstream(chat=refuses) as up:
        results, _ = await scored(config(tiny_models, up.url), group)
    assert "pair too long" in str(results[0]) and "content refused" in str(results[2])
    assert "pair too long" not in str(results[2])


@pytest.mark.asyncio
async def test_under_all_pairs_the_intransitive_rate_counts_the_triples_whose_pairs_all_answered(tiny_models,
                                                                                                 policy_tok):
    def one_pair_fails(payload):
        content = payload["messages"][0]["content"]
        if "answer 2" in content and "answer 8" in content:
            return Raw(400, {"error": {"message": "refused"}})
        return larger_wins(payload)

    group = [member(policy_tok, "t", j, f"answer {n}") for j, n in enumerate([2, 8, 5, 7])]
    with ScriptedUpstream(chat=one_pair_fails) as up:
        results, metrics = await scored(config(tiny_models, up.url), group)
    assert all(isinstance(r, Verdict) for r in results) and metrics["comparisons_failed"] == 2
    assert metrics["intransitive_rate"] == 0.0  # the 2 triples without the failed pair, both transitive


def test_a_logits_comparison_that_is_not_a_probability_fails_as_a_value():
    from verl_async_rm.errors import NonFiniteScoreError
    from verl_async_rm.scoring.pairwise_judge import PairwiseLogitsKind

    kind = PairwiseLogitsKind.__new__(PairwiseLogitsKind)  # read() needs no setting
    pair = GroupRequest("g", ())
    assert kind.read(pair, 0.25, None) == 0.25
    for value in (math.nan, 1.5, -0.1):
        assert isinstance(kind.read(pair, value, None), NonFiniteScoreError)


@pytest.mark.asyncio
async def test_a_partial_group_is_judged_with_the_responses_it_has(tiny_models, policy_tok):
    group = [member(policy_tok, "p", j, f"answer {n}") for j, n in enumerate([2, 8, 5])]  # 3 of 4
    with ScriptedUpstream(chat=larger_wins) as up:
        service = RMService(config(tiny_models, up.url), BatchPolicy(max_wait_ms=1), name="partial")
        await service.start()
        try:
            await service.withdraw("p", 4)  # the fourth's agent loop failed
            results = await asyncio.wait_for(asyncio.gather(*(service.score(r, 30.0) for r in group)), 20.0)
            metrics = await service.end_step()
        finally:
            await service.close()
    assert [r.score for r in results] == [0.0, 1.0, 0.5] and metrics["groups_partial"] == 1
    assert metrics["comparisons"] == 6


@pytest.mark.asyncio
async def test_a_cut_or_unreadable_reply_is_asked_again_then_the_comparison_fails(tiny_models, policy_tok):
    replies = iter([Completion('{"winner": "A', finish_reason="length"), Completion("A is better"),
                    Completion('{"winner": "B"}')] + [Completion("no idea")] * 10)
    group = [member(policy_tok, "q", j, f"answer {n}", 2) for j, n in enumerate([1, 2])]
    with ScriptedUpstream(chat=lambda p: next(replies)) as up:
        results, metrics = await scored(config(tiny_models, up.url, judge_retries=2, pair_orders="one"), group)
        chats = [s.body["messages"] for s in up.seen if s.path == "/v1/chat/completions"]
    # one order, asked three times: cut, unreadable, then B (the second shown) wins
    assert len(chats) == 3 and "cut at the limit of judge_max_tokens=16" in chats[1][2]["content"]
    assert "winner" in chats[2][2]["content"]
    shown_first = stated(chats[0][0]["content"].split("<response_a>")[1])
    winner = 1 if shown_first == 1 else 0  # member 1 states 2: it wins when shown second
    assert [r.score for r in results] == ([0.0, 1.0] if winner == 1 else [1.0, 0.0])
    assert (metrics["judge_reasks"], metrics["judge_cut_replies"], metrics["judge_parse_failures"]) == (2, 1, 2)


def test_the_logits_readout_is_p_a_over_p_a_plus_p_b_of_a_plain_forward(tiny_models, tiny_judges, policy_tok):
    import torch
    from judge_cases import TOKENS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_async_rm.scoring.scorer import RewardModelScorer

    cfg = RMConfig(model_path=str(tiny_judges.lm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                   reward_kind="pairwise_judge", judge_tokens=TOKENS)
    scorer = RewardModelScorer(cfg)
    a, b = member(policy_tok, "l", 0, "answer 3"), member(policy_tok, "l", 1, "it is 4 apples")
    pairs = [GroupRequest("l", (a, b)), GroupRequest("l", (b, a))]
    got = scorer.score(pairs)
    model = AutoModelForCausalLM.from_pretrained(tiny_judges.lm, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_judges.lm)
    ids = [tok(t, add_special_tokens=False)["input_ids"][0] for t in TOKENS]
    for pair, value in zip(pairs, got, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([scorer.kind.build(pair).ids])).logits[0, -1, ids]
        assert value == pytest.approx(float(torch.softmax(logits, -1)[0]), abs=1e-5)
    assert got[0] != pytest.approx(got[1])


@pytest.mark.parametrize(("settings", "key"), [
    ({"reward_kind": "judge", "pair_orders": "one"}, "pair_orders"),
    ({"pair_plan": "random_k"}, "pair_k"), ({"pair_k": 2}, "pair_k"),
    ({"judge_tokens": ["A", "B", "C"]}, "judge_tokens"), ({"judge_scale": 10.0}, "judge_scale")])
def test_the_pairwise_keys_are_checked_with_the_key_and_the_fix(tiny_models, tiny_judges, settings, key):
    base = {"reward_kind": "pairwise_judge", **settings}
    with pytest.raises(ConfigValueError) as err:
        RMConfig(model_path=str(tiny_judges.lm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False, **base)
    assert err.value.key == key and "Fix:" in str(err.value)


def test_a_reply_that_names_no_winner_fails_as_a_value_never_a_number():
    from types import SimpleNamespace

    from verl_async_rm.scoring.engine import Generated
    from verl_async_rm.scoring.pairwise_judge import PairwiseGenerateKind

    kind = PairwiseGenerateKind.__new__(PairwiseGenerateKind)  # read() needs only these settings
    kind.config = SimpleNamespace(model_path=None, endpoint=("http://judge:8000/v1",), judge_max_tokens=8)
    pair = GroupRequest("g", ())
    assert kind.read(pair, Generated('{"winner": "B"}', 4, "stop"), None) == 0.0
    for text in ('{"winner": "C"}', '{"better": "A"}', "A"):
        err = kind.read(pair, Generated(text, 4, "stop"), None)
        assert isinstance(err, JudgeVerdictError) and err.reply == text and err.reason


@pytest.mark.parametrize(("overrides", "refused"), [
    ([], True), (["actor_rollout_ref.rollout.val_kwargs.n=2"], False),
    (["trainer.val_before_train=False", "trainer.test_freq=-1"], False)])
def test_validation_with_lone_responses_is_refused_for_a_pairwise_judge(tiny_models, tiny_judges, overrides, refused):
    """verl validates with one response per prompt by default: a pairwise judge has nothing to compare it with."""
    from verl_async_rm.integration.checks import check_verl_config
    from verl_async_rm.testing import compose_trainer_config

    config = compose_trainer_config(tiny_models.policy, trainer="v0", overrides=[
        "reward.reward_model.enable_resource_pool=True", "reward.reward_model.n_gpus_per_node=1",
        "reward.reward_model.nnodes=1", f"reward.reward_model.model_path={tiny_judges.lm}",
        "reward.reward_manager.name=async_rm", "+async_rm.reward_kind=pairwise_judge",
        '+async_rm.judge_tokens=[" correct"," no"]', *overrides])
    if refused:
        with pytest.raises(ValueError, match=r"val_kwargs.n=1 response.*Fix: actor_rollout_ref.rollout.val_kwargs"):
            check_verl_config(config)
    else:
        assert check_verl_config(config).rm.reward_kind == "pairwise_judge"
