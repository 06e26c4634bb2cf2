"""Where the transformers engine reads an RM: the head's output at each row's last real token (outcome RMs), a named
field of the model's output (custom outputs, ArmoRM style), several positions per row (process RMs), or a judge's
next-token logits (:class:`JudgeLogits`); and how a head's outputs become one value (:func:`reduce_outputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verl_async_rm.errors import ConfigValueError, RewardModelError

__all__ = ["last_token_logits", "reduce_outputs", "reduce_row", "read_index", "per_token_logits", "field_scores",
           "check_output_field", "JudgeLogits"]


def last_token_logits(per_token: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``per_token[b, t]`` at each row's last position where ``attention_mask`` is 1: ``(B, T, L) -> (B, L)``."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    last = (positions * attention_mask.to(positions.dtype)).argmax(dim=-1).to(per_token.device)
    return per_token[torch.arange(per_token.shape[0], device=per_token.device), last]


def reduce_outputs(logits: torch.Tensor, reduction: str, index: int) -> torch.Tensor:
    """One score per row from ``(B, L)`` head outputs: ``logits[:, index]`` or a reduction over ``L`` (float32, or
    float64 for float64 outputs: the lists of an engine that returns them)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if reduction == "index":
        return logits[:, index]
    return {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}[reduction](logits, dim=-1)


def reduce_row(values: Sequence[float], reduction: str, index: int) -> float:
    """One row's score from its head outputs, by :func:`reduce_outputs` (engines that return lists: vLLM, an
    endpoint). ``ValueError`` when there is no output, or none at ``index``."""
    if not values:
        raise ValueError("the RM returned no output for the row")
    if reduction == "index" and not -len(values) <= index < len(values):
        raise ValueError(f"the RM returned {len(values)} output(s), no score_index={index}")
    return float(reduce_outputs(torch.tensor([list(values)], dtype=torch.float64), reduction, index)[0])


def read_index(reads: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row, position) of every read position, row after row."""
    rows = np.repeat(np.arange(len(reads), dtype=np.int64), [len(r) for r in reads])
    positions = np.fromiter((p for r in reads for p in r), dtype=np.int64, count=len(rows))
    return rows, positions


def per_token_logits(output: Any, shape: torch.Size) -> torch.Tensor:
    """The model's own ``(B, T, L)`` logits (token classification), for reading positions without a head hook."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(shape):
        raise RewardModelError(
            f"a process RM must give per-token logits (batch, tokens, labels); got {type(output).__name__} "
            "without them")
    return logits


def field_scores(output: Any, name: str, rows: int, reduction: str, index: int) -> torch.Tensor:
    """Scores from ``output.<name>``: ``(B,)`` as they are, ``(B, L)`` through :func:`reduce_outputs` (float32)."""
    value = _field(output, name)
    if not isinstance(value, torch.Tensor) or value.dim() not in (1, 2) or value.shape[0] != rows:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RewardModelError(
            f"score_output_field={name!r}: expected one value (or one row of values) per input, got {shape} for "
            f"{rows} row(s)")
    return value.float() if value.dim() == 1 else reduce_outputs(value, reduction, index)


def check_output_field(model: torch.nn.Module, ids: list[int], name: str, reduction: str, index: int,
                       device: torch.device) -> None:
    """Raise ``ValueError`` naming ``score_output_field`` (and the fields the output has) unless a one-row dry
    forward of ``ids`` gives one finite value, or one row of values that ``score_index`` can index, in that field."""
    with torch.no_grad():
        output = model(input_ids=torch.tensor([ids], device=device))
    value = _field(output, name)
    problem = None
    if value is None:
        problem = f"the output ({type(output).__name__}) has no field {name!r}"
    elif not isinstance(value, torch.Tensor) or value.dim() not in (1, 2) or value.shape[0] != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        problem = f"output.{name} is {shape}, not one scalar (or one row of outputs) per row"
    elif not bool(torch.isfinite(value.float()).all()):
        problem = f"output.{name} is not finite on a dry forward ({value.tolist()})"
    if problem is not None:
        names = ([str(k) for k in output.keys()] if isinstance(output, dict) else
                 sorted(k for k in vars(output) if not k.startswith("_")) if hasattr(output, "__dict__") else [])
        raise ConfigValueError("score_output_field", name, f"{problem}; the output has the fields {names}",
                               "set score_output_field to the field that holds the reward (one value per row)")
    width = value.shape[1] if value.dim() == 2 else 0
    if width and reduction == "index" and not -width <= index < width:
        raise ConfigValueError("score_index", index, f"output.{name} has {width} value(s) per row",
                               f"use an index in [{-width}, {width - 1}] or a score_reduction")


def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict) and name in output:  # ModelOutput is a dict too
        return output[name]
    return getattr(output, name, None)


class JudgeLogits(torch.nn.Module):
    """The LM head's rows of ``judge_tokens`` applied to final hidden states ``(N, H) -> (N, 1)``: the first token's
    probability renormalised over the listed tokens (two or more), or the token's raw logit (one). Gemma-style
    ``final_logit_softcapping`` is applied as the model does; other output scalings are caught by the load check."""

    def __init__(self, model: torch.nn.Module, token_ids: Sequence[int]) -> None:
        super().__init__()
        head = model.get_output_embeddings()
        index = torch.tensor(list(token_ids), device=head.weight.device)
        self.weight = _full(head.weight).index_select(0, index).clone()
        bias = getattr(head, "bias", None)
        self.bias = _full(bias).index_select(0, index).clone() if bias is not None else None
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)[..., :1]


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: an FSDP2-sharded one is gathered (every rank of a sharded replica calls this)."""
    param = param.detach()
    return param.full_tensor() if hasattr(param, "full_tensor") else param
