"""Packed (padding-free) RM forwards against real reference forwards, on the tiny offline models (CPU, float32).

The reference for every score is the plain HF model on that row alone (batch 1, no padding, no packing). A row of a
packed forward and the same row alone differ only by summation order: 1e-4 absolute / relative. A control packs the
rows with attention allowed across rows, to show the comparison catches a leak.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from rm_cases import direct_score, hf_model

from verl_async_rm.errors import RewardModelError
from verl_async_rm.scoring import packing
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.transformers_engine import TransformersEngine
from verl_async_rm.scoring.inputs import plan_micro_batches, plan_packed_micro_batches
from verl_async_rm.scoring.packing import pack_rows
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.scorer import RewardModelScorer

pytestmark = pytest.mark.unit

ATOL = RTOL = 1e-4
CPU = torch.device("cpu")


def random_rows(n: int, seed: int, vocab: int, lengths=(1, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@pytest.fixture(scope="module", params=["rm", "rm_alt"])
def model_path(request, tiny_models):
    """The tiny Qwen2 RM (grouped KV heads) and the tiny Llama RM."""
    return getattr(tiny_models, request.param)


def engine(path, packing_mode: str, **kwargs) -> TransformersEngine:
    model = hf_model(path)
    return TransformersEngine(model, model.score, device=CPU, pad_id=0, packing=packing_mode, **kwargs)


@pytest.fixture
def no_varlen_kernel(monkeypatch):
    """A device without a variable-length kernel (a GPU without flash-attn or torch's varlen_attn)."""
    monkeypatch.setattr(packing, "varlen_kernel_name", lambda device: None)


# --- pure parts -----------------------------------------------------------------------------------------------------


def test_pack_rows_restarts_positions_and_marks_row_ends():
    rows = pack_rows([[5, 6, 7], [8], [9, 10]], CPU)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert rows.cu_seqlens.tolist() == [0, 3, 4, 6] and rows.cu_seqlens.dtype == torch.int32
    assert rows.last.tolist() == [2, 3, 5] and rows.max_length == 3
    with pytest.raises(ValueError):
        pack_rows([[1], []], CPU)


@pytest.mark.parametrize("seed", range(5))
def test_packed_plan_budgets_real_tokens_and_places_every_input_once(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 7, 30, 64, 200, 900]) for _ in range(rng.randint(1, 80))]
    budget = 256
    plan = plan_packed_micro_batches(lengths, budget)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert sum(lengths[i] for i in batch) <= budget or len(batch) == 1  # an oversized input runs alone
    # counting real tokens, packing needs no more forwards than padding does
    assert len(plan) <= len(plan_micro_batches(lengths, budget))


# --- scores ---------------------------------------------------------------------------------------------------------


def test_auto_packs_on_cpu_through_the_varlen_attention_function(model_path):
    forward = engine(model_path, "auto")
    assert forward.kernel == "varlen"
    assert forward.describe()["packing"] == "packed (varlen: row_padded_sdpa)"
    assert forward.model.config._attn_implementation == packing.VARLEN_ATTENTION


@pytest.mark.parametrize("mode", ["auto", "true", "false"])
def test_packed_and_padded_scores_equal_single_row_forwards(model_path, mode):
    reference_model = hf_model(model_path)
    vocab = reference_model.config.vocab_size
    rows = random_rows(12, seed=1, vocab=vocab)
    forward = engine(model_path, mode)
    assert forward.packed == (mode != "false")
    expected = [direct_score(reference_model, ids) for ids in rows]
    for batch in forward.plan(rows, max_tokens=120):
        got = forward.forward_ids([rows[i] for i in batch]).tolist()
        assert got == pytest.approx([expected[i] for i in batch], abs=ATOL, rel=RTOL)


def test_without_a_varlen_kernel_true_fails_at_load_and_auto_pads(model_path, no_varlen_kernel):
    """Packing needs a variable-length kernel (transformers' block-diagonal mask is slower than padding)."""
    with pytest.raises(ValueError, match=r"^packing='true': no variable-length kernel on cpu .*Fix: use packing='auto'"):
        engine(model_path, "true")
    forward = engine(model_path, "auto")
    assert forward.kernel == "padded" and forward.describe()["packing"] == "padded"


def test_control_attention_across_rows_changes_the_scores(tiny_models):
    """The same packed row with one span for all rows (attention leaks across rows) fails the comparison."""
    forward = engine(tiny_models.rm, "true")
    rows = random_rows(4, seed=3, vocab=forward.model.config.vocab_size, lengths=(10, 20))
    good = forward.forward_ids(rows)
    leaky = pack_rows(rows, CPU)
    total = int(leaky.cu_seqlens[-1])
    with torch.inference_mode():
        forward.model(
            input_ids=leaky.input_ids, position_ids=leaky.position_ids, use_cache=False,
            cu_seq_lens_q=torch.tensor([0, total], dtype=torch.int32),
            cu_seq_lens_k=torch.tensor([0, total], dtype=torch.int32), max_length_q=total, max_length_k=total,
        )
        per_token, forward._captured = forward._captured, None
    leaked = per_token[0, leaky.last, 0]
    assert torch.allclose(good[0], leaked[0], atol=ATOL)  # the first row sees nothing else either way
    assert (good[1:] - leaked[1:]).abs().max() > 100 * ATOL


def test_a_row_that_makes_a_packed_forward_raise_fails_alone(tiny_models):
    forward = engine(tiny_models.rm, "true")
    reference_model = hf_model(tiny_models.rm)
    vocab = reference_model.config.vocab_size
    rows = random_rows(5, seed=4, vocab=vocab)
    poisoned = [*rows[:3], [*rows[3], vocab + 7], rows[4]]
    out = forward.score_batch(poisoned)
    assert isinstance(out[3], RewardModelError) and "index" in str(out[3]).lower()
    kept = [0, 1, 2, 4]
    assert [out[i] for i in kept] == pytest.approx(
        [direct_score(reference_model, rows[i]) for i in kept], abs=ATOL, rel=RTOL
    )


@pytest.mark.parametrize("mode", ["true", "false"])
def test_score_all_keeps_order_across_micro_batches_and_isolates_a_failing_row(tiny_models, mode):
    """Scores of all micro-batches are copied to the host at once; a micro-batch whose forward raises is bisected."""
    forward = engine(tiny_models.rm, mode)
    reference_model = hf_model(tiny_models.rm)
    vocab = reference_model.config.vocab_size
    rows = random_rows(14, seed=6, vocab=vocab)
    rows[9] = [*rows[9], vocab + 1]
    out = forward.score_all(rows, max_tokens=90)
    assert len(forward.plan(rows, 90)) >= 3
    assert isinstance(out[9], RewardModelError)
    kept = [i for i in range(len(rows)) if i != 9]
    assert [out[i] for i in kept] == pytest.approx(
        [direct_score(reference_model, rows[i]) for i in kept], abs=ATOL, rel=RTOL
    )


# --- models that cannot be packed -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_encoder():
    """A bidirectional encoder classifier (its head sees one pooled vector per row): packing cannot apply."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1)
    return BertForSequenceClassification(config).eval()


def test_auto_falls_back_to_padded_when_packed_scores_would_be_wrong(tiny_encoder, caplog):
    with caplog.at_level(logging.WARNING, logger="verl_async_rm.scoring.transformers_engine"):
        forward = TransformersEngine(tiny_encoder, tiny_encoder.classifier, device=CPU, pad_id=0, packing="auto")
    assert forward.kernel == "padded" and "packing=auto, but" in forward.packing_reason
    assert any("using padded forwards" in r.getMessage() for r in caplog.records)
    assert tiny_encoder.config._attn_implementation != packing.VARLEN_ATTENTION  # restored
    rows = random_rows(3, seed=5, vocab=120)
    with torch.inference_mode():
        expected = [float(tiny_encoder(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]
    assert forward.forward_ids(rows).tolist() == pytest.approx(expected, abs=ATOL, rel=RTOL)


def test_packing_true_on_a_model_that_cannot_pack_is_a_config_error(tiny_encoder, tiny_models):
    with pytest.raises(ValueError, match=r"packing='true': .*Fix: use packing='auto' or 'false'"):
        TransformersEngine(tiny_encoder, tiny_encoder.classifier, device=CPU, pad_id=0, packing="true")
    model = hf_model(tiny_models.rm)
    with pytest.raises(ValueError, match=r"packing='true': .*pooled logits.*Fix"):
        TransformersEngine(model, None, device=CPU, pad_id=0, packing="true")


@pytest.mark.parametrize(("value", "stored"), [(True, "true"), (False, "false"), ("auto", "auto")])
def test_packing_option_accepts_modes_and_hydra_booleans(value, stored):
    assert RMConfig(model_path="/m", retemplate="never", packing=value).packing == stored


def test_bad_packing_value_names_key_value_and_fix():
    with pytest.raises(ValueError, match=r"packing='sometimes': unknown mode. Fix: use one of"):
        RMConfig(model_path="/m", retemplate="never", packing="sometimes")


# --- the scorer ------------------------------------------------------------------------------------------------------


def test_scorer_reports_its_forwards_and_scores_alike_packed_or_padded(tiny_models, policy_tok):
    from rm_cases import make_batch

    requests = make_batch(policy_tok) + [RMRequest("x", [5, 6, 7], [8, 9])]
    common = {"model_path": str(tiny_models.rm), "policy_tokenizer_path": str(tiny_models.policy), "use_gpu": False}
    packed = RewardModelScorer(RMConfig(**common, packing="true"))
    padded = RewardModelScorer(RMConfig(**common, packing="false"))
    assert packed.describe()["packing"] == "packed (varlen: row_padded_sdpa)"
    assert padded.describe()["packing"] == "padded"
    assert packed.score(requests) == pytest.approx(padded.score(requests), abs=ATOL, rel=RTOL)


def test_verl_command_line_keys_reach_the_rm_config(tiny_models):
    """``+async_rm.packing=false`` and ``+async_rm.share_prompts=true`` (Hydra reads both as booleans)."""
    from verl_async_rm.config import AsyncRMConfig
    from verl_async_rm.testing import compose_trainer_config

    overrides = [
        "reward.reward_model.enable_resource_pool=True",
        "reward.reward_model.n_gpus_per_node=1",
        "reward.reward_model.nnodes=1",
        f"reward.reward_model.model_path={tiny_models.rm}",
        "reward.reward_manager.name=async_rm",
        "+async_rm.packing=false",
        "+async_rm.share_prompts=true",
    ]
    rm = AsyncRMConfig.from_verl(compose_trainer_config(tiny_models.policy, trainer="v1", overrides=overrides)).rm
    assert (rm.packing, rm.share_prompts) == ("false", "true")
    bad = compose_trainer_config(tiny_models.policy, trainer="v1", overrides=[*overrides[:5], "+async_rm.packing=on"])
    with pytest.raises(ValueError, match=r"async_rm.packing='on': unknown mode. Fix"):
        AsyncRMConfig.from_verl(bad)
