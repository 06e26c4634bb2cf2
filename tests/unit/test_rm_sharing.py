"""Shared prompts computed once: siblings' common prefix runs once per packed forward, scores unchanged.

References are real forwards of each row alone (the plain HF model, batch 1), in float32 on the CPU: 1e-4. A control
wires siblings to another group's prefix, to show that the comparison catches a wrong wiring.
"""

from __future__ import annotations

import random

import pytest
import torch
from rm_cases import direct_score, hf_model

from verl_async_rm.errors import RewardModelError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.transformers_engine import TransformersEngine
from verl_async_rm.scoring.scorer import RewardModelScorer
from verl_async_rm.scoring.sharing import common_prefix, plan_shared_micro_batches, shared_layout

pytestmark = pytest.mark.unit

ATOL = RTOL = 1e-4
CPU = torch.device("cpu")


def grpo_rows(groups: int, n: int, seed: int, vocab: int, prompt=(20, 40), response=(1, 30)):
    """``groups`` prompts with ``n`` responses each, plus the group label of every row."""
    rng = random.Random(seed)
    rows, labels = [], []
    for g in range(groups):
        prompt_ids = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))]
        for _ in range(n):
            rows.append(prompt_ids + [rng.randrange(3, vocab) for _ in range(rng.randint(*response))])
            labels.append(f"p{g}")
    return rows, labels


@pytest.fixture(scope="module", params=["rm", "rm_alt"])
def model_path(request, tiny_models):
    return getattr(tiny_models, request.param)


def engine(path, **kwargs) -> TransformersEngine:
    model = hf_model(path)
    kwargs.setdefault("share_prompts", "true")  # 'auto' shares on CUDA only
    return TransformersEngine(model, model.score, device=CPU, pad_id=0, packing="true", **kwargs)


# --- pure parts -----------------------------------------------------------------------------------------------------


def test_common_prefix_leaves_every_row_a_token_of_its_own():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert common_prefix([[1, 2, 3], [1, 2, 3]]) == 2  # identical rows: one token short
    assert common_prefix([[7, 1], [8, 1]]) == 0
    assert common_prefix([[1, 2, 3]]) == 2


def test_shared_layout_runs_each_prefix_once_and_gathers_it_for_each_sibling():
    batch = [[1, 2, 3, 4], [9, 9], [1, 2, 3, 7, 8]]
    layout = shared_layout(batch, ["a", None, "a"], CPU, min_prefix=2)
    # segments in first-seen order: the prefix [1, 2, 3], the siblings' own [4] and [7, 8], then [9, 9] alone
    assert layout.input_ids.tolist() == [[1, 2, 3, 4, 7, 8, 9, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1]]
    assert layout.cu_q.tolist() == [0, 3, 4, 6, 8]
    assert layout.key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 4, 5, 6, 7]
    assert layout.cu_k.tolist() == [0, 3, 7, 12, 14]
    assert layout.last.tolist() == [3, 7, 5] and (layout.max_q, layout.max_k) == (3, 5)
    assert (layout.computed, layout.saved) == (8, 3)
    assert shared_layout(batch, ["a", None, "a"], CPU, min_prefix=4).saved == 0  # prefix too short to share


@pytest.mark.parametrize("seed", range(4))
def test_shared_plan_keeps_siblings_together_within_the_budget(seed):
    rows, labels = grpo_rows(6, 5, seed, vocab=100, prompt=(20, 60), response=(1, 80))
    rng = random.Random(seed)
    rows += [[rng.randrange(3, 100) for _ in range(rng.randint(1, 90))] for _ in range(7)]
    labels += [None] * 7
    budget = 300
    plan = plan_shared_micro_batches(rows, labels, budget, min_prefix=16)
    assert sorted(i for batch in plan for i in batch) == list(range(len(rows)))
    for batch in plan:
        layout = shared_layout([rows[i] for i in batch], [labels[i] for i in batch], CPU, min_prefix=16)
        assert layout.computed <= budget or len(batch) == 1
    whole = 0
    for g in range(6):
        members = [i for i, label in enumerate(labels) if label == f"p{g}"]
        prefix = common_prefix([rows[i] for i in members])
        if prefix + sum(len(rows[i]) - prefix for i in members) <= budget:  # fits whole: never split
            assert sum(any(i in batch for i in members) for batch in plan) == 1
            whole += 1
    assert whole >= 1


# --- scores ---------------------------------------------------------------------------------------------------------


def test_shared_scores_equal_single_row_forwards(model_path):
    forward = engine(model_path, min_shared_prefix=8)
    assert forward.share_prompts and forward.describe()["share_prompts"] is True
    reference_model = hf_model(model_path)
    vocab = reference_model.config.vocab_size
    rows, labels = grpo_rows(3, 4, seed=1, vocab=vocab)
    rows += [[5, 6, 7, 8], list(range(3, 40))]  # no siblings
    labels += [None, "alone"]
    expected = [direct_score(reference_model, ids) for ids in rows]
    assert forward.score_all(rows, 10_000, labels) == pytest.approx(expected, abs=ATOL, rel=RTOL)
    prompts = sum(common_prefix([rows[i] for i, x in enumerate(labels) if x == f"p{g}"]) for g in range(3))
    assert forward.saved_tokens == 3 * prompts  # each group of 4 ran its prompt once instead of 4 times
    forward.saved_tokens = 0
    assert forward.score_all(rows, 60, labels) == pytest.approx(expected, abs=ATOL, rel=RTOL)  # small budget
    assert forward.saved_tokens > 0


def test_control_a_sibling_wired_to_another_groups_prompt_scores_differently(tiny_models):
    forward = engine(tiny_models.rm, min_shared_prefix=8)
    rows, labels = grpo_rows(2, 2, seed=2, vocab=forward.model.config.vocab_size, prompt=(30, 30))
    layout = shared_layout(rows, labels, CPU, min_prefix=8)
    good = forward.forward_ids(rows, labels)
    # the two prompts are the segments starting at 0 and at cu_q[3]; point group p1's responses at p0's prompt
    p1 = int(layout.cu_q[3])
    wrong = layout.key_index.clone()
    wrong[(wrong >= p1) & (wrong < p1 + 29)] -= p1
    with torch.inference_mode():
        forward.model(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False,
                      **{**layout.attention_kwargs(), "rm_key_index": wrong})
        per_token, forward._captured = forward._captured, None
    wired = per_token[0, layout.last, 0]
    assert torch.allclose(good[:2], wired[:2], atol=ATOL)  # group p0 is untouched
    assert (good[2:] - wired[2:]).abs().min() > 100 * ATOL


def test_a_sibling_that_makes_the_forward_raise_fails_alone(tiny_models):
    forward = engine(tiny_models.rm, min_shared_prefix=8)
    reference_model = hf_model(tiny_models.rm)
    vocab = reference_model.config.vocab_size
    rows, labels = grpo_rows(1, 5, seed=3, vocab=vocab)
    rows[2] = [*rows[2], vocab + 3]
    out = forward.score_all(rows, 10_000, labels)
    assert isinstance(out[2], RewardModelError)
    kept = [0, 1, 3, 4]
    assert [out[i] for i in kept] == pytest.approx(
        [direct_score(reference_model, rows[i]) for i in kept], abs=ATOL, rel=RTOL
    )


def test_sharing_is_off_when_disabled_without_the_varlen_kernel_and_by_default_on_cpu(tiny_models):
    assert engine(tiny_models.rm, share_prompts="false").share_prompts is False
    assert engine(tiny_models.rm, share_prompts="auto").share_prompts is False  # CPU: measured slower
    model = hf_model(tiny_models.rm)
    padded = TransformersEngine(model, model.score, device=CPU, pad_id=0, packing="false", share_prompts="true")
    assert padded.share_prompts is False


@pytest.mark.parametrize(("value", "stored"), [(True, "true"), (False, "false"), ("auto", "auto")])
def test_share_prompts_accepts_modes_and_hydra_booleans(value, stored):
    assert RMConfig(model_path="/m", retemplate="never", share_prompts=value).share_prompts == stored


def test_bad_share_prompts_value_names_key_value_and_fix():
    with pytest.raises(ValueError, match=r"share_prompts='yes': unknown mode. Fix: use one of"):
        RMConfig(model_path="/m", retemplate="never", share_prompts="yes")


def test_scorer_shares_grpo_siblings_prompts_and_scores_like_per_sample_forwards(tiny_models, policy_tok):
    """RMRequests of two prompts x 3 responses (group: the prompt), interleaved with a lone request."""
    from rm_cases import make_request

    question = "a farmer has twelve apples and gives away five of them to a friend, how many apples are left now"
    requests = [make_request(policy_tok, question if p == 0 else question + " exactly", answer, f"q{p}/{s}", f"q{p}")
                for s, answer in enumerate(["seven", "seven apples", "it is 7"]) for p in range(2)]
    requests.insert(3, make_request(policy_tok, "hi", "hello", "lone"))
    common = {"model_path": str(tiny_models.rm), "policy_tokenizer_path": str(tiny_models.policy), "use_gpu": False}
    shared = RewardModelScorer(RMConfig(**common, share_prompts="true"))
    unshared = RewardModelScorer(RMConfig(**common))  # 'auto': off on CPU
    assert shared.describe()["share_prompts"] is True and unshared.describe()["share_prompts"] is False
    model = hf_model(tiny_models.rm)
    expected = [direct_score(model, r.prompt_ids + r.response_ids) for r in requests]
    assert shared.score(requests) == pytest.approx(expected, abs=ATOL, rel=RTOL)
    assert unshared.score(requests) == pytest.approx(expected, abs=ATOL, rel=RTOL)
    assert shared.engine.saved_tokens >= 2 * 2 * 16 and unshared.engine.saved_tokens == 0
