"""The reward model in one process (no Ray): an RM kind composed with an engine.

- kinds (how a trajectory becomes input, what is checked, how a raw value becomes a score): :mod:`.outcome`,
  :mod:`.process`, :mod:`.judge`; their inputs: :mod:`.inputs`;
- engines (forwards, failing-row isolation, the load-time check): :mod:`.engine` (what both share),
  :mod:`.hf_engine` (transformers; :mod:`.readout`, :mod:`.packing`, :mod:`.sharing`, :mod:`.sharding`),
  :mod:`.vllm_engine`;
- :mod:`.scorer` (:class:`RewardModelScorer`, the composition), :mod:`.rm_config` (:class:`RMConfig`),
  :mod:`.checkpoint`, :mod:`.offload` and :mod:`.colocation` (the RM on the policy's GPUs).

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
