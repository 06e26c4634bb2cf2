"""verl_async_rm: score each verl trajectory the moment its agent loop ends, on an RM with its own resource pool.
The top-level import is cheap: verl, Ray and torch load when first used."""

from __future__ import annotations

import warnings as _warnings
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("verl-async-rm")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

#: verl releases this package is tested against.
SUPPORTED_VERL = ">=0.9.1,<0.10"

__all__ = ["__version__", "SUPPORTED_VERL", "AsyncRMAgentLoopManager", "verl_version_warning"]


def verl_version_warning(installed: str | None = None) -> str | None:
    """The message for an installed verl outside :data:`SUPPORTED_VERL` (None inside it, or without verl)."""
    try:
        from packaging.specifiers import SpecifierSet

        installed = installed or _metadata.version("verl")
    except (ImportError, _metadata.PackageNotFoundError):
        return None  # without verl the import that needs it says so
    if SpecifierSet(SUPPORTED_VERL).contains(installed, prereleases=True):
        return None
    return (f"verl_async_rm {__version__} is tested with verl{SUPPORTED_VERL}, but verl {installed} is installed: "
            "the methods it overrides may have changed (docs/versions.md lists what ran). Fix: pip install "
            f"'verl{SUPPORTED_VERL}', or a verl_async_rm release made for verl {installed}")


# once per process, on the first import (verl's plugin entry point imports this package in every process)
if (_message := verl_version_warning()) is not None:
    _warnings.warn(_message, stacklevel=2)


def __getattr__(name: str):
    # verl loads `verl_async_rm.AsyncRMAgentLoopManager` by name; import the heavy integration only then.
    if name == "AsyncRMAgentLoopManager":
        from verl_async_rm.integration.agent_loop_manager import AsyncRMAgentLoopManager

        return AsyncRMAgentLoopManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
