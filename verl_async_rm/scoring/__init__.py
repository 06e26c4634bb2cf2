"""The reward model in one process (no Ray): an RM kind (:mod:`.outcome`, :mod:`.process`, :mod:`.judge`) composed
with an engine (:mod:`.hf_engine`, :mod:`.vllm_engine`) by :class:`RewardModelScorer`. The config imports cheaply
(no torch); the scorer loads on first attribute access."""

from __future__ import annotations

import importlib
from typing import Any

from verl_async_rm.scoring.rm_config import RMConfig

__all__ = ["RMConfig", "RewardModelScorer"]


def __getattr__(name: str) -> Any:
    if name == "RewardModelScorer":
        return importlib.import_module("verl_async_rm.scoring.scorer").RewardModelScorer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
