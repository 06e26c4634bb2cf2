"""Random-weight reward models from public config shapes, an RL-like workload, and device peaks for MFU.

Nothing is downloaded: the shapes below are the public ``config.json`` values of each model, written out, and the
weights are random (built directly on the device). Throughput does not depend on the weights' values.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "build_random_rm", "build_random_causal_lm", "rl_workload", "peak_flops", "count_parameters"]

#: Public config shapes (``config.json`` fields), sequence classification with one output.
SHAPES: dict[str, dict[str, Any]] = {
    "llama8b": {  # meta-llama/Llama-3.1-8B
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "qwen0.5b": {  # Qwen/Qwen2.5-0.5B
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    },
    "small": {  # a 13M-parameter Qwen2 (heads of 64, which vLLM's CPU attention runs): engines compared on CPU
        "model_type": "qwen2", "vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024,
        "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
    },
    "tiny": {  # a tiny Qwen2 RM shape (heads of 16: transformers only on CPU, vLLM's CPU attention refuses them)
        "model_type": "qwen2", "vocab_size": 640, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
    },
}

#: Dense bf16 tensor-core peak FLOP/s by device-name substring (first match wins); MFU is null for other devices.
_PEAKS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12))


def _config_fields(shape: str | None, config_path: str | None) -> tuple[str, dict[str, Any]]:
    if config_path:
        path = Path(config_path)
        path = path / "config.json" if path.is_dir() else path
        fields = json.loads(path.read_text(encoding="utf-8"))
        fields = fields.get("text_config", fields) if "model_type" not in fields else fields
        if "model_type" not in fields:
            raise ValueError(f"--config {config_path}: no model_type in {path}. Fix: give a HF config.json")
        return str(path), dict(fields)
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r}: unknown. Fix: use one of {sorted(SHAPES)}, or --config config.json")
    return shape, dict(SHAPES[shape])


def build_random_rm(shape: str | None, config_path: str | None, device: Any, dtype: Any,
                    attn_implementation: str = "sdpa") -> tuple[Any, str]:
    """(model, name): a sequence-classification model with one output and random weights, built on ``device``."""
    from transformers import AutoModelForSequenceClassification

    name, fields = _config_fields(shape, config_path)
    for key in ("architectures", "auto_map", "torch_dtype", "dtype", "quantization_config"):
        fields.pop(key, None)
    fields.update(num_labels=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    return _random_model(AutoModelForSequenceClassification, fields, device, dtype, attn_implementation), name


def build_random_causal_lm(shape: str, device: Any, dtype: Any, **special_ids: int) -> Any:
    """A causal LM of ``SHAPES[shape]`` with random weights, built on ``device`` (judges, decode measurements);
    ``special_ids`` (pad/bos/eos token ids) default to 0, 1, 2, and a ``vocab_size`` given there widens the shape's."""
    from transformers import AutoModelForCausalLM

    _, fields = _config_fields(shape, None)
    fields.update({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **special_ids})
    fields["vocab_size"] = max(SHAPES[shape]["vocab_size"], fields["vocab_size"])
    return _random_model(AutoModelForCausalLM, fields, device, dtype, "sdpa")


def _random_model(auto_class: Any, fields: dict[str, Any], device: Any, dtype: Any, attn_implementation: str) -> Any:
    """``auto_class.from_config`` of ``fields`` (``model_type`` among them), seeded, built directly on ``device`` in
    ``dtype``, in eval mode without gradients."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = auto_class.from_config(config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval().requires_grad_(False)


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def rl_workload(
    n: int, seed: int, vocab: int, scale: int = 1, rollout_n: int = 1
) -> tuple[list[list[int]], list[str]]:
    """``n`` RM inputs with RL-like lengths, and their groups: prompt uniform in [64, 512] tokens, response log-normal
    (median 400, sigma 0.7) clipped to [16, 4096]; lengths divided by ``scale`` (at least 1 token each); ids uniform
    in [3, min(vocab, 32000)). Every ``rollout_n`` consecutive inputs are one group (GRPO's ``rollout.n`` responses
    to one prompt): they share the prompt's tokens and the group label."""
    rng = random.Random(seed)
    top = min(vocab, 32000)
    rows: list[list[int]] = []
    groups: list[str] = []
    prompt: list[int] = []
    for i in range(n):
        if i % rollout_n == 0:
            prompt = [rng.randrange(3, top) for _ in range(max(1, rng.randint(64, 512) // scale))]
        response = min(max(round(rng.lognormvariate(math.log(400), 0.7)), 16), 4096)
        rows.append(prompt + [rng.randrange(3, top) for _ in range(max(1, response // scale))])
        groups.append(f"{seed}-{i // rollout_n}")
    return rows, groups


def peak_flops(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of a known CUDA device, else None."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAKS if key in name), None)
