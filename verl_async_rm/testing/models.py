"""Tiny, deterministic, offline models for tests, the demo and benchmarks.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a seeded synthetic corpus, and randomly initialised
Qwen2/Llama models are built from small configs and saved with ``save_pretrained``. Three model directories come out:

- ``policy``: a ``Qwen2ForCausalLM`` with a ChatML tokenizer (``<|im_start|>``/``<|im_end|>``), pad id 0;
- ``rm``: a ``Qwen2ForSequenceClassification`` (``num_labels=1``) sharing the policy's tokenizer and template;
- ``rm_alt``: a ``LlamaForSequenceClassification`` with its own tokenizer (different vocabulary) and a Llama-3 style
  chat template whose rendering starts with BOS while the tokenizer adds BOS too, so template switching and duplicated
  BOS handling can be tested.

The whole set is a few MB and builds in seconds; it is rebuilt only when missing (or when ``force=True``). Builds are
atomic (a temporary folder renamed into place), so several processes may call :func:`build_tiny_models` at once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["TinyModels", "build_tiny_models", "default_cache_dir", "CHATML_TEMPLATE", "LLAMA3_TEMPLATE"]

#: Bump when the recipe below changes, so caches built by older versions are not reused.
_RECIPE_VERSION = "2"
_MARKER = "tiny_models.json"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is are was were be it that this for on with as at by from or not but what which who how "
    "many much more less than each every some all none one two three four five six seven eight nine ten hundred "
    "thousand number numbers sum total cost costs price prices apple apples orange oranges book books pen pens "
    "student students teacher class school day days week weeks hour hours minute minutes year years dollar dollars "
    "buy buys bought sell sells sold give gives gave take takes took make makes made has have had gets got left "
    "remaining answer question step think therefore so then first second third finally result equals plus minus "
    "times divided half twice double triple percent rate speed distance time mile miles store market farm farmer "
    "egg eggs chicken cow cows tree trees box boxes bag bags car cars train trains water milk bread cake pizza "
    "slice slices friend friends mother father brother sister family money save saves saved spend spends spent "
    "earn earns earned work works worked per if he she they we you i his her their our my your yes no correct wrong "
    "good bad helpful assistant user system reason carefully solve problem final"
).split()
_SYMBOLS = list("0123456789+-*/=().,?:$%") + ["####", "\n"]


@dataclass(frozen=True)
class TinyModels:
    """Paths of the tiny models built by :func:`build_tiny_models` (each a ``from_pretrained`` directory)."""

    root: Path
    policy: Path
    rm: Path
    rm_alt: Path


def default_cache_dir() -> Path:
    """``$VERL_ASYNC_RM_CACHE`` if set, else ``~/.cache/verl_async_rm``."""
    env = os.environ.get("VERL_ASYNC_RM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "verl_async_rm"


def build_tiny_models(cache_dir: str | os.PathLike | None = None, *, seed: int = 0, force: bool = False) -> TinyModels:
    """Build (or reuse) the tiny tokenizers and models under ``cache_dir`` and return their paths.

    Args:
        cache_dir: parent folder; the models go to ``<cache_dir>/tiny-models-v<recipe>-seed<seed>``.
            Defaults to :func:`default_cache_dir`.
        seed: seeds the corpus, the tokenizer training and the weights; the same seed gives the same files.
        force: rebuild even if a complete build exists.
    """
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = base / f"tiny-models-v{_RECIPE_VERSION}-seed{seed}"
    models = TinyModels(root=root, policy=root / "policy", rm=root / "rm", rm_alt=root / "rm_alt")
    build_atomically(root, lambda tmp: _build_into(tmp, seed), {"recipe": _RECIPE_VERSION, "seed": seed}, force)
    return models


def build_atomically(root: Path, build: Callable[[Path], None], marker: dict, force: bool = False) -> None:
    """Run ``build(tmp)`` into a temporary folder next to ``root`` and rename it into place, unless ``root`` holds a
    complete build (its marker file) and not ``force``. Several processes may race: the first rename wins and the
    others keep its identical build."""
    if (root / _MARKER).is_file() and not force:
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps(marker))
        if force and root.exists():
            shutil.rmtree(root)
        try:
            os.rename(tmp, root)
        except OSError:
            # Another process finished first: its build is identical (same recipe, same seed); keep it.
            if not (root / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s", root)


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    vocab = _WORDS + _SYMBOLS
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 24)
        lines.append(" ".join(rng.choice(vocab) if rng.random() < 0.8 else str(rng.randint(0, 999)) for _ in range(n)))
    return lines


def _train_tokenizer(seed: int, vocab_size: int, specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def _chatml_tokenizer(seed: int):
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = _train_tokenizer(seed, 640, specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token=None,
        additional_special_tokens=["</s>", "<|im_start|>"],
        model_max_length=2048,
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _llama3_tokenizer(seed: int):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _train_tokenizer(seed + 1, 520, specials)
    bos_id = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B", special_tokens=[
            ("<|begin_of_text|>", bos_id)
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        unk_token=None,
        additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
        model_max_length=2048,
        padding_side="right",
    )
    fast.chat_template = LLAMA3_TEMPLATE
    return fast


def _special_ids(tok) -> dict:
    return {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}


def _build_into(root: Path, seed: int) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    chatml = _chatml_tokenizer(seed)
    qwen_kwargs = dict(
        vocab_size=len(chatml),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head dimension 32: the smallest vLLM's CPU attention accepts, so the policy and RM also run on vLLM
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **_special_ids(chatml),
    )

    torch.manual_seed(seed)
    policy = Qwen2ForCausalLM(Qwen2Config(**qwen_kwargs)).eval()
    policy.generation_config = GenerationConfig(**_special_ids(chatml))
    policy.save_pretrained(root / "policy")
    chatml.save_pretrained(root / "policy")

    torch.manual_seed(seed + 1)
    rm = Qwen2ForSequenceClassification(Qwen2Config(num_labels=1, **qwen_kwargs)).eval()
    _widen_score_head(rm.score, seed + 1)
    rm.save_pretrained(root / "rm")
    chatml.save_pretrained(root / "rm")

    llama_tok = _llama3_tokenizer(seed)
    torch.manual_seed(seed + 2)
    rm_alt = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(llama_tok),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            num_labels=1,
            **_special_ids(llama_tok),
        )
    ).eval()
    _widen_score_head(rm_alt.score, seed + 2)
    rm_alt.save_pretrained(root / "rm_alt")
    llama_tok.save_pretrained(root / "rm_alt")


def _widen_score_head(head, seed: int) -> None:
    """Give the randomly initialised score head a larger spread so scores of different texts differ visibly."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen))
