"""The demo's reward model: the tiny models' tokenizer with a wider, deeper Qwen2 scoring head, built offline.

The tiny RM of :mod:`verl_async_rm.testing.models` scores a batch in milliseconds, far faster than any real RM next to
a rollout, so it would show no overlap. The demo RM keeps the same tokenizer and chat template (no re-templating) and
is sized so that scoring a step's batch on CPU takes about as long, relative to the simulated rollout, as a real RM
next to a real rollout (see ``DemoConfig.rm_hidden_size`` / ``rm_layers``). Built once per size and seed, atomically.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from verl_async_rm.testing.models import TinyModels

logger = logging.getLogger(__name__)

__all__ = ["HEAD_DIM", "build_demo_rm"]

#: The demo RM's head dimension (vLLM's CPU attention accepts 32, 64, 80, ...).
HEAD_DIM = 64

_MARKER = "demo_rm.json"
#: Bump when the recipe below changes, so caches built by older versions are not reused.
_RECIPE_VERSION = "2"


def build_demo_rm(tiny: TinyModels, *, hidden_size: int, num_layers: int, seed: int = 0) -> Path:
    """Build (or reuse) a ``Qwen2ForSequenceClassification`` RM next to the tiny models (same cache folder).

    It goes to ``<cache>/demo-rm-v<recipe>-seed<seed>-h<hidden>-l<layers>``, beside ``tiny.root``, never inside it.
    """
    root = tiny.root.parent / f"demo-rm-v{_RECIPE_VERSION}-seed{seed}-h{hidden_size}-l{num_layers}"
    if (root / _MARKER).is_file():
        return root
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=tiny.root.parent))
    try:
        _build_into(tmp, tiny.policy, hidden_size, num_layers, seed)
        (tmp / _MARKER).write_text(json.dumps({"hidden_size": hidden_size, "num_layers": num_layers, "seed": seed}))
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / _MARKER).is_file():  # another process won the race with an identical build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the demo RM in %s", root)
    return root


def _kv_heads(heads: int) -> int:
    """Grouped-query attention as in Qwen2: the largest divisor of ``heads`` that is at most half of it (or 1)."""
    return max((d for d in range(1, heads // 2 + 1) if heads % d == 0), default=1)


def _build_into(folder: Path, tokenizer_dir: Path, hidden_size: int, num_layers: int, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed + 11)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        # head dimension 64, which vLLM's CPU attention accepts: verl's served RM runs this RM on vLLM
        num_attention_heads=hidden_size // HEAD_DIM,
        num_key_value_heads=_kv_heads(hidden_size // HEAD_DIM),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = Qwen2ForSequenceClassification(config).eval()
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():  # a wider score head, so the scores of different responses differ visibly
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) / hidden_size**0.5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
