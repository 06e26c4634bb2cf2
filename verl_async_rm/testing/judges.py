"""Tiny judge models (causal LMs) for the judge-RM tests, the demo and benchmarks, built offline next to the tiny
models.

Each uses the tiny policy's ChatML tokenizer, so a response is read back as the policy wrote it, and vLLM's CPU
attention runs them (head dimension 32):

- ``lm``: a random ``Qwen2ForCausalLM`` with the ChatML template and a widened LM head, so its next-token
  probabilities differ visibly between judge prompts (the ``logits`` readout's tests).
- ``digit``: a one-layer ``Qwen2ForCausalLM`` whose next token is a fixed function of the current token, with a
  margin no numerical path can flip: one-hot embeddings, attention and MLP outputs zeroed (the residual stream is the
  embedding), and LM-head rows that map every other token to a digit (:func:`digit_of`), each digit to the next one
  and 9 to the end of the text. Greedy, it counts up from the first digit to 9 and ends ("789"; at most ten digits and
  the end, cut when ``max_tokens`` is shorter; an input that ends in the digit 9 gets an empty reply); which digit
  comes first depends only on the judge input's last token. Its chat template writes the messages' text as it is,
  with an empty generation prompt, so that token is the end of ``judge_prompt`` as rendered (the ``generate``
  readout's tests: verdicts known in advance, and a pattern such as ``^([0-4])`` that leaves some of them
  unparseable). Its :data:`LOGITS_TOKENS` come next, their odds also set by that last token (a logits readout served
  elsewhere, whose top log-probabilities must hold them).
- ``json``: the ``digit`` judge's shape (one layer, one-hot embeddings, the residual stream is the embedding) whose
  LM head makes it end a number at once: after a digit it prefers ``}``, then ``,``; after ``}`` the end of the text;
  after anything else, the digit ``7``. Free, it writes ``7}`` and ends; constrained to a group judge's JSON schema (a
  number per label), it writes ``{"1":7,"2":7,...}`` and stops (the group judge's tests on vLLM's structured output).
  ChatML template.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_async_rm.testing.models import _chatml_tokenizer, _special_ids, build_atomically, default_cache_dir

__all__ = ["TinyJudges", "build_tiny_judges", "digit_of", "RAW_TEMPLATE", "LOGITS_TOKENS", "JSON_DIGIT"]

_RECIPE_VERSION = "5"
#: The number the ``json`` judge gives every label.
JSON_DIGIT = 7
#: The ``digit`` judge's two logits-readout tokens: the next token after its digit, their odds set by the input's last
#: token (a judge served elsewhere returns them among its first token's top log-probabilities).
LOGITS_TOKENS = (" correct", " no")
#: The ``digit`` judge's chat template: the messages' text, nothing around it, and no generation prompt.
RAW_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(frozen=True)
class TinyJudges:
    """Paths of the tiny judges (each a ``from_pretrained`` directory)."""

    root: Path
    lm: Path
    digit: Path
    json: Path


def digit_of(token_id: int) -> int:
    """The digit the ``digit`` judge writes first after a non-digit token."""
    return (token_id * 7 + 3) % 10


def build_tiny_judges(cache_dir: str | os.PathLike | None = None, *, seed: int = 0, force: bool = False) -> TinyJudges:
    """Build (or reuse) the tiny judges under ``cache_dir`` (default: :func:`default_cache_dir`)."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = base / f"tiny-judges-v{_RECIPE_VERSION}-seed{seed}"
    build_atomically(root, lambda tmp: _build_into(tmp, seed), {"recipe": _RECIPE_VERSION, "seed": seed}, force)
    return TinyJudges(root=root, lm=root / "lm", digit=root / "digit", json=root / "json")


def _build_into(root: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _chatml_tokenizer(seed)
    vocab = len(tok)
    torch.manual_seed(seed + 10)
    lm = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, **_special_ids(tok),
    )).eval()
    with torch.no_grad():
        lm.lm_head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed + 11))
    lm.generation_config = GenerationConfig(**_special_ids(tok))
    lm.save_pretrained(root / "lm")
    tok.save_pretrained(root / "lm")

    hidden = 32 * -(-vocab // 32)  # one-hot embeddings need hidden >= vocab; heads of 32
    digit = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32, max_position_embeddings=2048,
        tie_word_embeddings=False, **_special_ids(tok),
    )).eval()
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    with torch.no_grad():
        digit.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        layer = digit.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        for token in range(vocab):
            after = (tok.eos_token_id if token == digits[9] else digits[digits.index(token) + 1]) \
                if token in digits else digits[digit_of(token)]
            head[after, token] = 1.0
        # a logits judge's two tokens: always next after the digit (a margin of 0.4 of the digit's logit, so greedy
        # text is unchanged), their odds a fixed function of the input's last token
        spread = torch.Generator().manual_seed(seed + 12)
        for word in LOGITS_TOKENS:
            head[tok.convert_tokens_to_ids(tok.tokenize(word))[0]] = 0.5 + 0.1 * (torch.rand(hidden, generator=spread)
                                                                                  - 0.5)
        digit.lm_head.weight.copy_(head)
    digit.generation_config = GenerationConfig(**_special_ids(tok))
    digit.save_pretrained(root / "digit")
    _json_judge(vocab, hidden, digits, tok).save_pretrained(root / "json")
    tok.save_pretrained(root / "json")
    tok.chat_template = RAW_TEMPLATE
    tok.save_pretrained(root / "digit")


def _json_judge(vocab: int, hidden: int, digits: list[int], tok) -> Any:
    """The ``json`` judge (see the module doc)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32, max_position_embeddings=2048,
        tie_word_embeddings=False, **_special_ids(tok),
    )).eval()
    close, comma = tok.convert_tokens_to_ids("}"), tok.convert_tokens_to_ids(",")
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        head[digits[JSON_DIGIT], :vocab] = 1.0
        for token in digits:
            head[digits[JSON_DIGIT], token] = 0.0
            head[close, token], head[comma, token] = 2.0, 1.5
        head[digits[JSON_DIGIT], close] = 0.0
        head[tok.eos_token_id, close] = 1.0
        model.lm_head.weight.copy_(head)
    model.generation_config = GenerationConfig(**_special_ids(tok))
    return model
