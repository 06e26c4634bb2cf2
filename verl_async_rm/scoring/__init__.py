"""The reward model in one process: settings, input building, forwards, one score per request (no Ray).

- :mod:`~verl_async_rm.scoring.rm_config`: :class:`RMConfig` (what an RM replica needs);
- :mod:`~verl_async_rm.scoring.checkpoint`: checks and loading of the RM checkpoint and tokenizers;
- :mod:`~verl_async_rm.scoring.inputs`: re-templating, BOS de-duplication, truncation (pure);
- :mod:`~verl_async_rm.scoring.scorer`: :class:`RewardModelScorer`: load the RM, build inputs, count;
- :mod:`~verl_async_rm.scoring.forward`: padded or packed forwards, score extraction, per-item failure isolation;
- :mod:`~verl_async_rm.scoring.packing`: packed rows and the variable-length attention kernels;
- :mod:`~verl_async_rm.scoring.sharing`: GRPO siblings' common prompt computed once per packed forward;
- :mod:`~verl_async_rm.scoring.judge_text`, :mod:`~verl_async_rm.scoring.judge`: judge RMs' prompt and verdict, and
  their two readouts (next-token logits, or a verdict written on vLLM).

Usage::

    scorer = RewardModelScorer(RMConfig(model_path=..., policy_tokenizer_path=...))
    scorer.score([RMRequest(...), ...])          # one score, or the exception that failed it, per request

The config imports cheaply (no torch); the scorer loads on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_async_rm.scoring.rm_config import RMConfig

__all__ = ["RMConfig", "RewardModelScorer"]


def __getattr__(name: str) -> Any:
    if name == "RewardModelScorer":
        return importlib.import_module("verl_async_rm.scoring.scorer").RewardModelScorer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
