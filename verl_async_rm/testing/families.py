"""Tiny offline reward models of the families users bring, and their model cards' own scoring recipes.

Each model is random-weight and tiny (2 layers, hidden 32), saved with ``save_pretrained`` next to a tokenizer
trained offline (byte-level BPE) that carries a chat template like its public counterpart's: BOS written by the
template, the default system message, role names. :func:`build_family_models` builds them once (cached, atomic);
:func:`reference_score` and :func:`reference_step_probabilities` score a conversation the way each public model card
does, in plain transformers and fp32: what the plugin's replicas must reproduce.

| name | like | class |
|---|---|---|
| ``llama`` | Skywork-Reward-Llama-3.1-8B | ``LlamaForSequenceClassification``, Llama 3.1 template (default system) |
| ``gemma2`` | Skywork-Reward-Gemma-2-27B | ``Gemma2ForSequenceClassification``, Gemma template (no system role) |
| ``qwen2`` | Skywork-Reward-V2-Qwen2.5 | ``Qwen2ForSequenceClassification``, Qwen2.5 ChatML (default system) |
| ``qwen3`` | Skywork-Reward-V2-Qwen3 | ``Qwen3ForSequenceClassification``, ChatML (no default system) |
| ``mistral`` | Mistral-based RMs | ``MistralForSequenceClassification``, ``[INST]`` template |
| ``internlm2`` | internlm2-7b-reward | own code (``AutoModel``): value head, reward token, ``get_score`` |
| ``armorm`` | ArmoRM-Llama3-8B-v0.1 | own code (``AutoModelForSequenceClassification``): custom output, ``score`` |
| ``prm`` | Qwen2.5-Math-PRM-7B | ``Qwen2ForTokenClassification`` (2 labels), ``<extra_0>`` after each step |
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

from verl_async_rm.testing.models import _train_tokenizer, _widen_score_head, build_atomically, default_cache_dir

__all__ = [
    "FAMILIES",
    "OUTCOME_FAMILIES",
    "build_family_models",
    "family_settings",
    "reference_score",
    "reference_step_probabilities",
]

FAMILIES: tuple[str, ...] = ("llama", "gemma2", "qwen2", "qwen3", "mistral", "internlm2", "armorm", "prm")
OUTCOME_FAMILIES = FAMILIES[:-1]
#: Bump when a recipe below changes, so caches built by older versions are not reused.
_RECIPE_VERSION = "1"
_CUSTOM_CODE = "tiny_custom_rm"  # custom_rms.py's name inside a model directory

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SYSTEM_DEFAULT = (  # ChatML with a default system message when the conversation has none
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n@SYSTEM@<|im_end|>\n{% endif %}" + _CHATML
)
_LLAMA31 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}"
    "{% set system = 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_GEMMA = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

#: name -> (template, special tokens (pad, bos, eos, others...), whether the tokenizer adds BOS itself)
_TOKENIZERS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "llama": (_LLAMA31, ("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                         "<|end_header_id|>"), True),
    "gemma2": (_GEMMA, ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), True),
    "qwen2": (_SYSTEM_DEFAULT.replace("@SYSTEM@", "You are Qwen, created by Alibaba Cloud. You are a helpful "
                                                  "assistant."), ("<|endoftext|>", None, "<|im_end|>", "<|im_start|>"),
              False),
    "qwen3": (_CHATML, ("<|endoftext|>", None, "<|im_end|>", "<|im_start|>"), False),
    "mistral": (_MISTRAL, ("<pad>", "<s>", "</s>", "[INST]", "[/INST]"), True),
    "internlm2": ("{{ bos_token }}" + _CHATML, ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
                                               "[UNUSED_TOKEN_130]"), True),
    "armorm": (_LLAMA3, ("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                         "<|end_header_id|>"), True),
    "prm": (_SYSTEM_DEFAULT.replace("@SYSTEM@", "Please reason step by step, and put your final answer within "
                                                "\\boxed{}."), ("<|endoftext|>", None, "<|im_end|>", "<|im_start|>",
                                                                  "<extra_0>"), False),
}
_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048)


def build_family_models(cache_dir: str | os.PathLike | None = None, *, seed: int = 0,
                        force: bool = False) -> dict[str, Path]:
    """Build (or reuse) every family's tiny RM under ``<cache_dir>/tiny-families-v<recipe>-seed<seed>``; returns
    name -> model directory. ``cache_dir`` defaults to :func:`~verl_async_rm.testing.models.default_cache_dir`."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = base / f"tiny-families-v{_RECIPE_VERSION}-seed{seed}"

    def build(tmp: Path) -> None:
        for k, name in enumerate(FAMILIES):
            _build_one(name, tmp / name, seed + 10 * k)

    build_atomically(root, build, {"recipe": _RECIPE_VERSION, "seed": seed}, force)
    return {name: root / name for name in FAMILIES}


def family_settings(name: str) -> dict[str, Any]:
    """The ``async_rm`` keys a user sets for an RM of that family (beyond its path)."""
    return {
        "internlm2": {"trust_remote_code": True},
        "armorm": {"trust_remote_code": True, "score_output_field": "score"},
        "prm": {"reward_kind": "process", "step_separator": "<extra_0>"},
    }.get(name, {})


def reference_score(name: str, path: str | os.PathLike, messages: list[dict]) -> float:
    """``messages`` scored as the family's model card does (fp32): ``get_score`` for ``internlm2``; the
    chat-templated ids through the model, ``output.score`` for ``armorm`` and ``logits[0][0]`` for the others."""
    import torch

    tokenizer, model = _load(name, str(path))
    with torch.inference_mode():
        if name == "internlm2":
            return float(model.get_score(tokenizer, messages))
        ids = _input_ids(tokenizer.apply_chat_template(messages, tokenize=True, return_tensors="pt"))
        output = model(input_ids=ids)
        return float(output.score[0] if name == "armorm" else output.logits[0][0])


def reference_step_probabilities(path: str | os.PathLike, messages: list[dict], steps: list[str],
                                 separator: str = "<extra_0>", label_index: int = 1) -> list[float]:
    """The Qwen2.5-Math-PRM card's recipe: the steps joined by ``separator`` and ended with one as the assistant
    turn, the rendered conversation encoded, softmax over the labels, ``label_index``'s probability at each
    separator."""
    import torch

    tokenizer, model = _load("prm", str(path))
    content = separator.join(steps) + separator
    text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": content}], tokenize=False,
                                         add_generation_prompt=False)
    ids = tokenizer.encode(text, return_tensors="pt")
    with torch.inference_mode():
        probabilities = torch.softmax(model(input_ids=ids).logits.float(), dim=-1)[0, :, label_index]
    return probabilities[ids[0] == tokenizer.convert_tokens_to_ids(separator)].tolist()


# ------------------------------------------------------------------------------------------------------ building


def _input_ids(encoded: Any) -> Any:
    """transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding; 4.x a tensor."""
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


@functools.lru_cache(maxsize=None)
def _load(name: str, path: str) -> tuple[Any, Any]:
    import torch
    import transformers

    auto = {"internlm2": "AutoModel", "prm": "AutoModelForTokenClassification"}.get(
        name, "AutoModelForSequenceClassification")
    remote = name in ("internlm2", "armorm")
    model = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32, trust_remote_code=remote).eval()
    return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=remote), model


def _tokenizer(name: str, seed: int) -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    template, (pad, bos, eos, *others), adds_bos = _TOKENIZERS[name]
    specials = [t for t in (pad, bos, eos, *others) if t is not None]
    tok = _train_tokenizer(seed, 600, specials)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=None,
                                   additional_special_tokens=others, model_max_length=2048, padding_side="right")
    fast.chat_template = template
    return fast


def _build_one(name: str, out: Path, seed: int) -> None:
    import torch
    import transformers

    tok = _tokenizer(name, seed)
    ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    torch.manual_seed(seed)
    if name in ("internlm2", "armorm"):
        from verl_async_rm.testing import custom_rms

        if name == "internlm2":
            config = custom_rms.TinyInternLM2Config(reward_token_id=tok.convert_tokens_to_ids("[UNUSED_TOKEN_130]"),
                                                    **_SIZES, **ids)
            model, head, auto = custom_rms.TinyInternLM2ForRewardModel(config), "v_head", "AutoModel"
        else:
            config = custom_rms.TinyArmoRMConfig(**_SIZES, **ids)
            model = custom_rms.TinyArmoRMForRewardModelWithGating(config)
            head, auto = "regression_layer", "AutoModelForSequenceClassification"
        config.auto_map = {"AutoConfig": f"{_CUSTOM_CODE}.{type(config).__name__}",
                           auto: f"{_CUSTOM_CODE}.{type(model).__name__}"}
    else:
        kind = {"llama": "Llama", "gemma2": "Gemma2", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
                "prm": "Qwen2"}[name]
        extra: dict[str, Any] = {"num_labels": 2 if name == "prm" else 1}
        if name == "gemma2":  # no soft-capping (sdpa has none) and a window longer than any test input
            extra.update(head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=None, sliding_window=4096)
        if name == "qwen3":
            extra.update(head_dim=8)
        config = getattr(transformers, f"{kind}Config")(**_SIZES, **ids, **extra)
        task = "TokenClassification" if name == "prm" else "SequenceClassification"
        model, head = getattr(transformers, f"{kind}For{task}")(config), "score"
    _widen_score_head(getattr(model, head), seed)
    if name == "prm":  # label probabilities away from 0 and 1, so step scores compare meaningfully
        with torch.no_grad():
            model.score.weight.mul_(0.2)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    if name in ("internlm2", "armorm"):
        shutil.copyfile(Path(__file__).with_name("custom_rms.py"), out / f"{_CUSTOM_CODE}.py")
