"""verl integration: the agent-loop manager and workers (they import verl's agent loop, so they load on first use)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncRMAgentLoopManager", "AsyncRMAgentLoopManagerV0", "AsyncRMAgentLoopManagerV1"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("verl_async_rm.integration.agent_loop_manager"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
