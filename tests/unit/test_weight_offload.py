"""``WeightOffload`` and the scorer's sleep/wake: weights leave the device and come back bit for bit, the scores
are the same before and after a cycle, tied weights move once, and a second sleep or wake moves nothing."""

from __future__ import annotations

import pytest
import torch
from rm_cases import make_batch

from verl_async_rm.scoring.offload import WeightOffload
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.scorer import RewardModelScorer

pytestmark = pytest.mark.unit


def held_bytes(offload: WeightOffload) -> int:
    """Bytes of the model's tensors held on its device now (0 when asleep)."""
    return sum(t.numel() * t.element_size() for t in offload._tensors())


def test_a_cycle_restores_every_weight_exactly_and_frees_the_devices_copy(tiny_models):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_models.rm, dtype=torch.float32).eval()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits.clone()
    offload = WeightOffload(model, torch.device("cpu"))
    total = held_bytes(offload)
    slept = offload.sleep()
    assert offload.asleep and slept.bytes == total > 0 and held_bytes(offload) == 0
    assert all(p.numel() == 0 for p in model.parameters())  # the device's copy is gone
    assert offload.sleep().bytes == 0  # already asleep
    woke = offload.wake()
    assert woke.bytes == total and not offload.asleep and offload.wake().bytes == 0
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference)


def test_tied_weights_move_once_and_stay_tied():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied, as a causal LM's head often is
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    offload = WeightOffload(model, torch.device("cpu"))
    assert offload.sleep().bytes == 10 * 4 * 4
    offload.wake()
    assert head.weight is embed.weight and head.weight.shape == (10, 4)


def test_later_sleeps_reuse_the_host_buffers_and_copy_the_current_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    offload = WeightOffload(model, torch.device("cpu"))
    offload.sleep()
    buffers = {name: copy.data_ptr() for name, copy in zip(("weight", "bias"), offload._buffers.values(), strict=True)}
    offload.wake()
    with torch.no_grad():
        model.weight.add_(1.0)  # changed while awake: the next sleep must carry the new values, not stale ones
    expected = model.weight.detach().clone()
    offload.sleep()
    assert [c.data_ptr() for c in offload._buffers.values()] == list(buffers.values())  # no new allocation
    offload.wake()
    assert torch.equal(model.weight, expected)
    assert model.weight.data_ptr() not in buffers.values()  # awake weights never alias the host buffers


def test_the_scorer_scores_the_same_after_a_sleep_and_wake(tiny_models, policy_tok):
    config = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      placement="policy_pool")
    scorer = RewardModelScorer(config)
    requests = make_batch(policy_tok)
    before = scorer.score(requests)
    moved = scorer.sleep()
    assert scorer.asleep and moved.bytes > 0
    assert scorer.wake().bytes == moved.bytes and not scorer.asleep
    assert scorer.score(requests) == before
