"""The RM service: one Ray actor per RM. All but the batcher import Ray and verl, so they load on first access."""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {"service": ("RMService", "call_replica", "start_rm_service", "launch_rm_services",
                        "wait_rm_services"),
            "batcher": ("Batcher",), "batching": ("BatchPolicy",), "client": ("score_with_timeout",), "replica": ("RMReplica",),
            "placement": ("RMResourcePool", "create_rm_worker_group", "shutdown_rm_worker_group", "ReplicaFactory")}
_LAZY = {name: f"verl_async_rm.service.{module}" for module, names in _MODULES.items() for name in names}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
