"""The demo's reward model: a ``Qwen2ForSequenceClassification`` with the tiny policy's tokenizer whose score is a fixed
function of which tokens the text uses, built offline, so the tiny policy can raise it within the demo's steps.

Its score rises with the share of the tokens (prompt, response and chat template, as the RM reads them) that start
with a vowel (:func:`vowel_token_ids`; about a quarter of the tiny vocabulary). A random RM would give GRPO a signal
the policy cannot follow in a few steps; this one rewards a token-level habit that a few updates can change. The
weights are set, not trained:

- each token's embedding is ``c * e0`` plus ``e1`` for a vowel token; the first layer's attention has zero query and
  key weights, so every position attends uniformly to all positions before it, and its value/output projections
  copy the (normalised) vowel flag into ``e2``: at the last position, ``e2`` holds the share of vowel tokens;
- every other projection that writes into the residual stream is zero, so the remaining layers compute (and cost
  what a real RM of this size costs, ``hidden_size`` and ``num_layers``) without changing that;
- the score head reads ``e2`` after the final norm: monotone in the share, about ``SCORE_SCALE`` times it.

The same function on transformers and on vLLM (verl's served RM), uniform attention being position-independent.
Built once per size and seed, atomically.
"""

from __future__ import annotations

import logging
from pathlib import Path

from verl_async_rm.testing.models import TinyModels, build_atomically

logger = logging.getLogger(__name__)

__all__ = ["HEAD_DIM", "SCORE_SCALE", "build_demo_rm", "vowel_token_ids"]

#: The demo RM's head dimension (vLLM's CPU attention accepts 32, 64, 80, ...).
HEAD_DIM = 64
#: About how much the score grows per unit of vowel-token share (share 0.25 -> about 2.5).
SCORE_SCALE = 10.0
#: The embedding's constant component ``c`` (module doc): larger keeps the score closer to linear in the share.
_BASE = 4.0
#: Bump when the recipe below changes, so caches built by older versions are not reused.
_RECIPE_VERSION = "3"


def vowel_token_ids(tokenizer) -> list[int]:
    """Ids of the ordinary tokens whose text (without leading spaces) starts with a vowel."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special
            and tokenizer.decode([i]).lstrip()[:1].lower() in ("a", "e", "i", "o", "u")]


def build_demo_rm(tiny: TinyModels, *, hidden_size: int, num_layers: int, seed: int = 0) -> Path:
    """Build (or reuse) the demo RM next to the tiny models (same cache folder, never inside ``tiny.root``):
    ``<cache>/demo-rm-v<recipe>-seed<seed>-h<hidden>-l<layers>``."""
    if hidden_size % HEAD_DIM or hidden_size < HEAD_DIM:
        raise ValueError(f"demo RM hidden_size={hidden_size}: must be a multiple of {HEAD_DIM} (heads of {HEAD_DIM}, "
                         "which vLLM's CPU attention accepts), e.g. 256")
    if num_layers < 1:
        raise ValueError(f"demo RM num_layers={num_layers}: must be >= 1, e.g. 2")
    root = tiny.root.parent / f"demo-rm-v{_RECIPE_VERSION}-seed{seed}-h{hidden_size}-l{num_layers}"
    marker = {"hidden_size": hidden_size, "num_layers": num_layers, "seed": seed}
    build_atomically(root, lambda tmp: _build_into(tmp, tiny.policy, hidden_size, num_layers, seed), marker)
    return root


def _build_into(folder: Path, tokenizer_dir: Path, hidden_size: int, num_layers: int, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed + 11)
    heads = hidden_size // HEAD_DIM
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=2048, tie_word_embeddings=False, num_labels=1, rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    model = Qwen2ForSequenceClassification(config).eval()
    vowels = torch.tensor(vowel_token_ids(tok))
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 0] = _BASE
        embed[vowels, 1] = 1.0
        for layer in model.model.layers:  # nothing but the first layer's copy writes into the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.fill_(1.0)
        first = model.model.layers[0].self_attn
        for proj in (first.q_proj, first.k_proj):  # uniform attention over the prefix
            proj.weight.zero_()
            proj.bias.zero_()
        first.v_proj.weight.zero_()
        first.v_proj.bias.zero_()
        first.v_proj.weight[0, 1] = 1.0  # head 0, value dim 0 <- the normalised vowel flag
        first.o_proj.weight[2, 0] = 1.0  # -> residual dim 2
        model.model.norm.weight.fill_(1.0)
        model.score.weight.zero_()
        # final norm: e2 * sqrt(hidden) / sqrt(c^2 + e2^2); e2 = share * sqrt(hidden) / sqrt(c^2 + 1)
        scale = (_BASE ** 2 + 1) ** 0.5 * _BASE / hidden_size
        model.score.weight[0, 2] = SCORE_SCALE * scale
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
