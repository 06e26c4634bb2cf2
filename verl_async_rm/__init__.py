"""verl_async_rm: score each verl trajectory the moment its agent loop ends, on an RM with its own resource pool.
The top-level import is cheap: verl, Ray and torch load when first used."""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("verl-async-rm")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

#: verl releases this package is tested against.
SUPPORTED_VERL = ">=0.9.1,<0.10"

__all__ = ["__version__", "SUPPORTED_VERL", "AsyncRMAgentLoopManager"]


def __getattr__(name: str):
    # verl loads `verl_async_rm.AsyncRMAgentLoopManager` by name; import the heavy integration only then.
    if name == "AsyncRMAgentLoopManager":
        from verl_async_rm.integration.agent_loop_manager import AsyncRMAgentLoopManager

        return AsyncRMAgentLoopManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
