"""Any HuggingFace reward model as a verl worker group on its own Ray resource pool.

Layout (one job per module):

- :mod:`~verl_async_rm.rm.config`: :class:`RMConfig` and :func:`rm_config_from_verl` (verl keys, legacy keys);
- :mod:`~verl_async_rm.rm.request`: :class:`RMRequest`, the item scored (built from a verl ``AgentLoopOutput``);
- :mod:`~verl_async_rm.rm.inputs`: re-templating, BOS de-duplication, truncation, micro-batch planning (pure);
- :mod:`~verl_async_rm.rm.scorer`: :class:`RewardModelScorer`, model loading and input building;
- :mod:`~verl_async_rm.rm.forward`: :class:`~verl_async_rm.rm.forward.RMForward`, padded or packed forwards, score
  extraction, failure isolation;
- :mod:`~verl_async_rm.rm.packing`: packed rows and the variable-length attention kernels;
- :mod:`~verl_async_rm.rm.sharing`: GRPO siblings' common prompt computed once per packed forward;
- :mod:`~verl_async_rm.rm.worker`: :class:`RewardModelWorker`, the verl ``Worker`` holding one replica;
- :mod:`~verl_async_rm.rm.pool`: :class:`RMResourcePool` and the worker group's creation and shutdown;
- :mod:`~verl_async_rm.rm.batch_fn`: :class:`RMBatchFn`, the executor's ``batch_fn(items, slot)``;
- :mod:`~verl_async_rm.rm.replicas`: :class:`ReplicaFactory`, the executor's ``replace_slot`` for a dead replica.

Usage::

    cfg = rm_config_from_verl(verl_config)                 # or RMConfig(model_path=..., policy_tokenizer_path=...)
    wg = create_rm_worker_group(cfg)                       # reserves the pool, loads the RM on every replica
    slots = wg.workers                                     # one executor slot per replica
    scores = await RMBatchFn.from_config(cfg)(requests, slots[0])   # floats, or exceptions per item
    shutdown_rm_worker_group(wg)

Config and request modules import cheaply; the others (torch, verl, Ray) load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_async_rm.rm.config import ConfigValueError, RMConfig, rm_config_from_verl
from verl_async_rm.rm.request import RMRequest

__all__ = [
    "RMConfig",
    "ConfigValueError",
    "rm_config_from_verl",
    "RMRequest",
    "RewardModelScorer",
    "RewardModelWorker",
    "RMResourcePool",
    "create_rm_worker_group",
    "shutdown_rm_worker_group",
    "score_with_group",
    "RMBatchFn",
    "ReplicaFactory",
]

_LAZY = {
    "RewardModelScorer": "verl_async_rm.rm.scorer",
    "RewardModelWorker": "verl_async_rm.rm.worker",
    "RMResourcePool": "verl_async_rm.rm.pool",
    "create_rm_worker_group": "verl_async_rm.rm.pool",
    "shutdown_rm_worker_group": "verl_async_rm.rm.pool",
    "score_with_group": "verl_async_rm.rm.pool",
    "RMBatchFn": "verl_async_rm.rm.batch_fn",
    "ReplicaFactory": "verl_async_rm.rm.replicas",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
