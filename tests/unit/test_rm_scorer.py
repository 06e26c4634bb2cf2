"""The RM scorer in-process (no Ray) with the tiny offline models: equivalence with a direct HF forward.

Tolerance: float32 on CPU; a row of a padded batch and the same row alone differ only by summation order,
so scores must agree within 1e-4 (absolute) / 1e-4 (relative).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from rm_cases import ANSWERS, QUESTIONS, direct_score, hf_model, make_batch, make_request

from verl_async_rm.errors import NonFiniteScoreError, RewardInputError, RewardModelError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.readout import last_token_logits, reduce_outputs
from verl_async_rm.scoring.scorer import RewardModelScorer

pytestmark = pytest.mark.unit

ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def requests_(policy_tok):
    return make_batch(policy_tok)


def cpu_config(model_path, policy_path, **kwargs) -> RMConfig:
    return RMConfig(model_path=str(model_path), policy_tokenizer_path=str(policy_path), use_gpu=False, **kwargs)


@pytest.fixture(scope="module")
def scorer(tiny_models):
    return RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy))


def test_batched_scores_equal_per_sample_hf_forward(scorer, tiny_models, requests_):
    assert scorer.kind.retemplate is False  # same tokenizer and template: the policy's ids are reused
    model = hf_model(tiny_models.rm)
    scores = scorer.score(requests_)
    expected = [direct_score(model, r.prompt_ids + r.response_ids) for r in requests_]
    assert scores == pytest.approx(expected, abs=ATOL, rel=RTOL)
    assert len(set(round(s, 3) for s in scores)) == len(scores), "distinct texts should get distinct scores"


def test_micro_batch_budget_does_not_change_scores(tiny_models, requests_, scorer):
    small = RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy, micro_batch_max_tokens=8))
    assert small.score(requests_) == pytest.approx(scorer.score(requests_), abs=ATOL, rel=RTOL)


def test_score_is_read_at_the_last_valid_token_not_by_pad_id(scorer, tiny_models, policy_tok):
    """A response ending in a token equal to pad_token_id (0 here): HF's own pooling skips it, the scorer does not."""
    pad = policy_tok.pad_token_id
    req = make_request(policy_tok, QUESTIONS[0], ANSWERS[1], "pad-end")
    req.response_ids = [*req.response_ids[:-1], pad]
    short = make_request(policy_tok, QUESTIONS[2], "five", "short")  # shorter row: the first one gets padded
    model = hf_model(tiny_models.rm)
    ids = torch.tensor([req.prompt_ids + req.response_ids])
    with torch.inference_mode():
        per_token = model.score(model.model(input_ids=ids).last_hidden_state)
        hf_pooled = float(model(input_ids=ids).logits[0, 0])
    at_last = float(per_token[0, -1, 0])
    got = scorer.score([req, short])[0]
    assert got == pytest.approx(at_last, abs=ATOL, rel=RTOL)
    assert not math.isclose(hf_pooled, at_last, abs_tol=1e-3), "HF's pad-id pooling reads an earlier token"


def test_template_switch_equals_rendering_by_hand(tiny_models, policy_tok, requests_):
    from transformers import AutoTokenizer

    alt = RewardModelScorer(cpu_config(tiny_models.rm_alt, tiny_models.policy))
    assert alt.kind.retemplate is True
    alt_tok = AutoTokenizer.from_pretrained(tiny_models.rm_alt)
    model = hf_model(tiny_models.rm_alt)
    expected = []
    for request, answer in zip(requests_, ANSWERS, strict=True):
        conversation = [*request.raw_prompt, {"role": "assistant", "content": answer}]
        text = alt_tok.apply_chat_template(conversation, tokenize=False)
        text = text.removeprefix(alt_tok.bos_token)  # the tokenizer adds its own BOS
        expected.append(direct_score(model, alt_tok(text)["input_ids"]))
    assert alt.score(requests_) == pytest.approx(expected, abs=ATOL, rel=RTOL)


def test_truncation_keeps_the_response_end_and_is_counted(tiny_models, policy_tok, caplog):
    long = make_request(policy_tok, "how many apples " * 30, "the answer is five", "long")
    short = make_request(policy_tok, "two plus two", "four", "short")
    trunc = RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy, max_length=16))
    ids, cut = trunc.prepare(long)
    assert cut and ids == (long.prompt_ids + long.response_ids)[-16:]
    model = hf_model(tiny_models.rm)
    scores = trunc.score([long, short])
    assert scores[0] == pytest.approx(direct_score(model, ids), abs=ATOL, rel=RTOL)
    assert trunc.stats().truncated == 2 - (short.num_tokens <= 16)
    with caplog.at_level(logging.INFO, logger="verl_async_rm.scoring.scorer"):
        step = trunc.pop_step_stats()
    assert step.truncated == trunc.stats().truncated and step.requests == 2
    assert sum("truncated to max_length=16" in r.getMessage() for r in caplog.records) == 1
    assert trunc.pop_step_stats().requests == 0


def test_nan_score_fails_only_its_item(nan_rm, tiny_models, requests_, scorer):
    path, poison = nan_rm
    good = requests_[0]
    bad = RMRequest("bad", good.prompt_ids, [*good.response_ids[:-1], poison, 4], good.raw_prompt)
    nan_scorer = RewardModelScorer(cpu_config(path, tiny_models.policy))
    results = nan_scorer.score([requests_[0], bad, requests_[1]])
    assert isinstance(results[1], NonFiniteScoreError) and "bad" in str(results[1])
    assert [results[0], results[2]] == pytest.approx(scorer.score([requests_[0], requests_[1]]), abs=ATOL, rel=RTOL)
    assert nan_scorer.stats().failed == 1


def test_bad_input_fails_only_its_item(tiny_models, requests_):
    alt = RewardModelScorer(cpu_config(tiny_models.rm_alt, tiny_models.policy))
    no_prompt = RMRequest("np", requests_[0].prompt_ids, requests_[0].response_ids)
    results = alt.score([requests_[0], no_prompt])
    assert isinstance(results[0], float)
    assert isinstance(results[1], RewardInputError)


@pytest.fixture(scope="module")
def three_output_rm(tiny_models, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_models.rm, num_labels=3)
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    path = tmp_path_factory.mktemp("rm3")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_models.rm).save_pretrained(path)
    return path


@pytest.mark.parametrize(("options", "pick"), [
    ({"score_index": 2}, lambda row: row[2]),
    ({"score_index": -1}, lambda row: row[2]),
    ({"score_reduction": "mean"}, lambda row: sum(row) / 3),
    ({"score_reduction": "max"}, max),
])
def test_multi_output_head_index_or_reduction(three_output_rm, tiny_models, requests_, options, pick):
    model = hf_model(three_output_rm)
    with torch.inference_mode():
        rows = [model(input_ids=torch.tensor([r.prompt_ids + r.response_ids])).logits[0].tolist() for r in requests_]
    multi = RewardModelScorer(cpu_config(three_output_rm, tiny_models.policy, **options))
    assert multi.score(requests_) == pytest.approx([pick(row) for row in rows], abs=ATOL, rel=RTOL)


def test_out_of_range_score_index_is_a_config_error(three_output_rm, tiny_models):
    with pytest.raises(ValueError, match=r"score_index=3: .* has 3 output\(s\).*Fix"):
        RewardModelScorer(cpu_config(three_output_rm, tiny_models.policy, score_index=3))


def test_model_own_logits_path_and_missing_head(tiny_models, requests_, scorer):
    own = RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy, score_head="none"))
    assert own.engine.head is None
    assert own.score(requests_) == pytest.approx(scorer.score(requests_), abs=ATOL, rel=RTOL)
    with pytest.raises(ValueError, match=r"score_head='reward_head'.*Fix"):
        RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy, score_head="reward_head"))


def test_missing_model_dir_is_a_clear_error(tiny_models, tmp_path):
    from verl_async_rm.errors import RewardModelError

    with pytest.raises(RewardModelError, match=r"model_path=.*is not a directory.*Fix"):
        RewardModelScorer(cpu_config(tmp_path / "nope", tiny_models.policy))


def test_score_extraction_helpers():
    per_token = torch.arange(2 * 4 * 2, dtype=torch.float32).reshape(2, 4, 2)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])  # right- and left-padded rows
    assert last_token_logits(per_token, mask).tolist() == [[2.0, 3.0], [14.0, 15.0]]
    logits = torch.tensor([[1.0, 3.0], [2.0, 6.0]])
    assert reduce_outputs(logits, "index", 1).tolist() == [3.0, 6.0]
    assert reduce_outputs(logits, "sum", 0).tolist() == [4.0, 8.0]
    assert reduce_outputs(logits, "min", 0).tolist() == [1.0, 2.0]


def test_a_row_that_makes_the_forward_raise_fails_alone(scorer, tiny_models, requests_):
    """A token id outside the RM's vocabulary makes the embedding raise: the micro-batch is split until that row is
    isolated, and every other row still gets its own score."""
    model = hf_model(tiny_models.rm)
    rows = [r.prompt_ids + r.response_ids for r in requests_]
    assert len(rows) >= 3
    vocab = scorer.model.get_input_embeddings().num_embeddings
    poisoned = list(rows)
    poisoned[2] = rows[2][:-1] + [vocab + 7]
    with pytest.raises(IndexError):  # the poison really makes the model raise
        scorer.forward_ids([poisoned[2]])
    out = scorer.engine.score_batch(poisoned)
    assert isinstance(out[2], RewardModelError) and "index" in str(out[2]).lower()
    kept = [i for i in range(len(rows)) if i != 2]
    assert [out[i] for i in kept] == pytest.approx([direct_score(model, rows[i]) for i in kept], abs=ATOL, rel=RTOL)


def test_scorer_builds_and_scores_without_importing_verl_ray_or_omegaconf(tiny_models):
    """The GPU machines that benchmark the scorer have torch and transformers only: RewardModelScorer(config) with
    no device must not reach for verl (it picked its device through verl before)."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from verl_async_rm.scoring.rm_config import RMConfig\n"
        "from verl_async_rm.request import RMRequest\n"
        "from verl_async_rm.scoring.scorer import RewardModelScorer\n"
        f"scorer = RewardModelScorer(RMConfig(model_path={str(tiny_models.rm)!r}, retemplate='never', use_gpu=False))\n"
        "scores = scorer.score([RMRequest('a', [5, 6, 7], [8, 9]), RMRequest('b', [5], [6])])\n"
        "print(json.dumps({'device': str(scorer.device), 'scores': scores,\n"
        "                  'imported': [m for m in ('verl', 'ray', 'omegaconf') if m in sys.modules]}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and all(isinstance(s, float) for s in result["scores"])
    assert result["imported"] == []
