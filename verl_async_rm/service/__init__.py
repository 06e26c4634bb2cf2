"""The RM service: one Ray actor per RM. All but the batcher import Ray and verl, so they load on first access."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RMService": "verl_async_rm.service.service",
    "ReplicaCall": "verl_async_rm.service.service",
    "start_rm_service": "verl_async_rm.service.service",
    "start_rm_services": "verl_async_rm.service.service",
    "Batcher": "verl_async_rm.service.batcher",
    "BatchPolicy": "verl_async_rm.service.batcher",
    "score_with_timeout": "verl_async_rm.service.client",
    "RMReplica": "verl_async_rm.service.replica",
    "RMResourcePool": "verl_async_rm.service.placement",
    "create_rm_worker_group": "verl_async_rm.service.placement",
    "shutdown_rm_worker_group": "verl_async_rm.service.placement",
    "ReplicaFactory": "verl_async_rm.service.placement",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
