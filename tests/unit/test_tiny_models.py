"""The tiny offline models: deterministic, small, loadable, with the tokenizer quirks the RM code must handle."""

from __future__ import annotations

import hashlib

import pytest

from verl_async_rm.testing import build_tiny_models

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "how many apples"}, {"role": "assistant", "content": "the answer is 42"}]


def _digests(root):
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path, tiny_models):
    again = build_tiny_models(tmp_path / "a", seed=0)
    assert _digests(again.root) == _digests(tiny_models.root)
    other = build_tiny_models(tmp_path / "b", seed=1)
    assert _digests(other.root)["rm/model.safetensors"] != _digests(again.root)["rm/model.safetensors"]


def test_rebuilt_only_when_missing(tmp_path):
    first = build_tiny_models(tmp_path)
    weights = first.rm / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_models(tmp_path).rm == first.rm
    assert weights.stat().st_mtime_ns == mtime
    build_tiny_models(tmp_path, force=True)
    assert weights.stat().st_mtime_ns != mtime


def test_whole_set_is_a_few_megabytes(tiny_models):
    total = sum(p.stat().st_size for p in tiny_models.root.rglob("*") if p.is_file())
    assert total < 5 * 2**20


def test_policy_and_rm_load_and_share_a_chatml_tokenizer(tiny_models):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    rm_tok = AutoTokenizer.from_pretrained(tiny_models.rm)
    assert tok.get_vocab() == rm_tok.get_vocab() and tok.chat_template == rm_tok.chat_template
    assert tok.pad_token_id == 0  # the unsafe case for pad-based last-token lookup
    assert tok.bos_token is not None and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text.startswith("<|im_start|>user\nhow many apples<|im_end|>")
    assert tok.decode(tok(text)["input_ids"]) == text

    policy = AutoModelForCausalLM.from_pretrained(tiny_models.policy)
    assert type(policy).__name__ == "Qwen2ForCausalLM"
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_models.rm)
    assert type(rm).__name__ == "Qwen2ForSequenceClassification" and rm.config.num_labels == 1
    with torch.no_grad():
        logits = rm(torch.tensor([tok(text)["input_ids"]])).logits
    assert logits.shape == (1, 1) and torch.isfinite(logits).all()


def test_alt_rm_has_its_own_tokenizer_and_a_duplicated_bos(tiny_models):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    alt = AutoTokenizer.from_pretrained(tiny_models.rm_alt)
    assert alt.get_vocab() != tok.get_vocab()
    text = alt.apply_chat_template(MESSAGES, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    ids = alt(text)["input_ids"]
    assert ids[:2] == [alt.bos_token_id, alt.bos_token_id]  # template BOS + tokenizer BOS
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_models.rm_alt)
    assert type(rm).__name__ == "LlamaForSequenceClassification"
    with torch.no_grad():
        assert torch.isfinite(rm(torch.tensor([ids[1:]])).logits).all()
