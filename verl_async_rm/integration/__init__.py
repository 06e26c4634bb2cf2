"""verl integration: the agent-loop manager and workers that score each trajectory as soon as it ends.

Importing this package imports verl's agent loop (heavy); :mod:`verl_async_rm` exposes
``AsyncRMAgentLoopManager`` lazily.
"""

from verl_async_rm.integration.manager import (
    AsyncRMAgentLoopManager,
    AsyncRMAgentLoopManagerV0,
    AsyncRMAgentLoopManagerV1,
)

__all__ = ["AsyncRMAgentLoopManager", "AsyncRMAgentLoopManagerV0", "AsyncRMAgentLoopManagerV1"]
