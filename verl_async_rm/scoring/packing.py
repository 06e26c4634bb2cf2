"""Packed forwards: a micro-batch's rows as one ``(1, T)`` sequence, positions restarting per row, attention kept
in each row by :func:`varlen_attention_forward` (registered with transformers' ``AttentionInterface``): a
variable-length kernel on CUDA, only the attention padded on CPU (so CPU tests run the GPU's wiring)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

__all__ = [
    "VARLEN_ATTENTION", "PackedRows", "pack_rows", "choose_kernel", "varlen_kernel_name", "register_varlen_attention",
    "varlen_attention_forward"]

#: The name the varlen attention function is registered under in transformers' ``AttentionInterface``.
VARLEN_ATTENTION = "verl_async_rm_varlen"


@dataclass
class PackedRows:
    """One packed forward's inputs on the device: ``(1, T)`` ids and positions, the ``(N + 1,)`` int32 row
    boundaries, the ``(N,)`` index of every row's last token, and the longest row."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    last: torch.Tensor
    max_length: int

    def varlen_kwargs(self) -> dict[str, Any]:
        """The keyword arguments HF passes down to every attention call (flash-attention's names)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.max_length,
            "max_length_k": self.max_length}


def flat_ids(rows: Sequence[Sequence[int]], total: int) -> np.ndarray:
    """The rows' token ids concatenated (int64), built in C (``torch.tensor`` of a Python list is ~4x slower)."""
    return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total)


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``range(starts[0], starts[0] + lengths[0]), range(starts[1], ...), ...`` concatenated, without a loop."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=device.type == "cuda")


def pack_rows(batch: Sequence[Sequence[int]], device: torch.device) -> PackedRows:
    """:class:`PackedRows` of ``batch`` (non-empty rows), built on the host in one pass and copied once."""
    lengths = np.fromiter((len(ids) for ids in batch), dtype=np.int64, count=len(batch))
    if len(batch) == 0 or int(lengths.min()) < 1:
        raise ValueError("pack_rows needs at least one row and no empty row")
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1])
    # position of token j of the whole pack = j - start of its row
    positions = concat_ranges(np.zeros_like(starts), lengths)
    return PackedRows(input_ids=to_device(flat_ids(batch, total), device)[None],
                      position_ids=to_device(positions, device)[None],
                      cu_seqlens=to_device(np.concatenate([[0], ends]).astype(np.int32), device),
                      last=to_device(ends - 1, device), max_length=int(lengths.max()))


# ------------------------------------------------------------------------------------------------------ kernels


@functools.cache
def _flash_attn_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        # flash-attn >= 2.1: with fewer queries than keys the causal mask is aligned to the bottom right
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)

    return run


@functools.cache
def _torch_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any]
    if "window_size" in params:  # torch >= 2.10: causal is a (-1, 0) window
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:  # torch 2.9
        causal = {"is_causal": True}
    else:
        return None
    gqa = "enable_gqa" in params

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        extra = {"enable_gqa": True} if gqa and q.shape[1] != k.shape[1] else {}
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal, **extra)

    return run


def _row_padded_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """The CPU kernel: each segment's attention padded to ``(segments, heads, longest, D)``, one causal sdpa. A
    segment's queries sit at the end of its keys (a shared prefix first), so the causal mask is aligned bottom-right as
    flash-attention's; a real query never sees a padded key."""
    del max_q  # queries are placed in the keys' frame
    q_len, k_len = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    segments = len(q_len)
    seg = torch.arange(segments, device=q.device)

    def padded(x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((segments, max_k, *x.shape[1:]))
        out[rows, pos] = x
        return out.transpose(1, 2)  # (segments, heads, max_k, D)

    q_rows = torch.repeat_interleave(seg, q_len)
    q_pos = torch.arange(q.shape[0], device=q.device) - torch.repeat_interleave(cu_q[:-1].long(), q_len)
    q_pos = q_pos + (k_len - q_len)[q_rows]
    k_rows = torch.repeat_interleave(seg, k_len)
    k_pos = torch.arange(k.shape[0], device=k.device) - torch.repeat_interleave(cu_k[:-1].long(), k_len)
    qp, kp, vp = padded(q, q_rows, q_pos), padded(k, k_rows, k_pos), padded(v, k_rows, k_pos)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        kp, vp = kp.repeat_interleave(groups, 1), vp.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
    return out.transpose(1, 2)[q_rows, q_pos]


#: CUDA's variable-length kernels, preferred first: name -> the kernel's finder (None where it is not installed).
_CUDA_KERNELS = {"flash_attn": _flash_attn_varlen, "torch_varlen": _torch_varlen}


def varlen_kernel_name(device: torch.device) -> str | None:
    """The variable-length kernel :func:`varlen_attention_forward` runs on ``device``: ``'flash_attn'``,
    ``'torch_varlen'``, ``'row_padded_sdpa'`` (CPU), or None (no such kernel for this device)."""
    if device.type == "cpu":
        return "row_padded_sdpa"
    if device.type != "cuda":
        return None
    return next((name for name, find in _CUDA_KERNELS.items() if find() is not None), None)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention for packed rows (``cu_seq_lens_q/k`` in ``kwargs``; ``rm_key_index`` for a shared
    prefix). Raises on what it cannot honour (a padding mask, sliding window, soft-capping, sinks), so such a model
    fails the load-time check instead of scoring wrongly."""
    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if not getattr(module, "is_causal", True):
        unsupported.append("bidirectional attention")
    if attention_mask is not None or unsupported or kwargs.get("cu_seq_lens_q") is None:
        raise RuntimeError(
            f"{VARLEN_ATTENTION}: packed rows only (got attention_mask={attention_mask is not None}, "
            f"cu_seq_lens_q={kwargs.get('cu_seq_lens_q') is not None}, unsupported={unsupported})")
    if query.shape[0] != 1:
        raise RuntimeError(f"{VARLEN_ATTENTION}: expects one packed row, got a batch of {query.shape[0]}")
    cu_q, max_q = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    cu_k, max_k = kwargs.get("cu_seq_lens_k", cu_q), int(kwargs.get("max_length_k", max_q))
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    key_index = kwargs.get("rm_key_index")
    if key_index is not None:  # each segment's keys: its shared prefix's, then its own
        k, v = k.index_select(0, key_index), v.index_select(0, key_index)
    name = varlen_kernel_name(query.device)
    run = _row_padded_sdpa if name == "row_padded_sdpa" else _CUDA_KERNELS[name]() if name else None
    if run is None:
        raise RuntimeError(f"{VARLEN_ATTENTION}: no variable-length attention kernel on {query.device}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = run(q, k, v, cu_q, cu_k, max_q, max_k, scaling)
    return out[None], None


def register_varlen_attention() -> None:
    """Register :func:`varlen_attention_forward` with transformers as :data:`VARLEN_ATTENTION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)


# ------------------------------------------------------------------------------------------------------ choice


def choose_kernel(model: torch.nn.Module, device: torch.device, mode: str, per_token_head: bool) -> tuple[str, str]:
    """``(kernel, why)`` for ``packing=mode``: ``'varlen'`` or ``'padded'``. Packing needs a variable-length kernel
    (transformers' own block-diagonal mask does ``T x T`` work, slower than padding: 7.5k against 90k tok/s)."""
    if mode == "false":
        return "padded", "packing=false"
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    why_not = None
    if not per_token_head:
        why_not = "the score is the model's own pooled logits (score_head='none' or no per-token head)"
    elif getattr(config, "is_encoder_decoder", False):
        why_not = f"{type(model).__name__} is an encoder-decoder model"
    elif not getattr(model, "_supports_attention_backend", False):
        why_not = f"{type(model).__name__} does not route its attention through transformers' AttentionInterface"
    elif any(t != "full_attention" for t in (getattr(text_config, "layer_types", None) or [])):
        why_not = "some layers use sliding-window (or other non-full) attention"
    elif getattr(text_config, "use_sliding_window", False) and getattr(text_config, "sliding_window", None):
        why_not = "the model uses sliding-window attention"
    if why_not is not None:
        return "padded", f"packing={mode}, but {why_not}"
    varlen = varlen_kernel_name(device)
    if varlen is not None:
        return "varlen", f"packing={mode}: variable-length attention ({varlen})"
    return "padded", f"packing={mode}, but no variable-length kernel on {device} (install flash-attn, or torch >= 2.9)"
