"""Entry point of the ``verl.plugins`` group, imported on ``import verl`` in every process: cheap, never raises.

It registers the ``async_rm`` reward manager the moment verl's reward-manager registry is imported (a one-shot hook on
``sys.meta_path``), not before: importing that stack eagerly would roughly double the time of ``import verl`` in every
process. A failure is logged (verl would only say ``Unknown reward manager: async_rm``).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading

logger = logging.getLogger(__name__)

__all__ = ["REGISTRY_MODULE", "register_reward_manager"]

#: verl's reward-manager package; importing it registers verl's own managers.
REGISTRY_MODULE = "verl.experimental.reward_loop.reward_manager"

_lock = threading.Lock()
_registered = False


def register_reward_manager() -> bool:
    """Register ``async_rm`` with verl's registry now (idempotent). Returns whether it is registered."""
    global _registered
    with _lock:
        if _registered:
            return True
        try:
            import verl_async_rm.integration.reward_manager  # noqa: F401  (the @register decorator runs on import)
        except Exception:
            logger.exception("verl_async_rm: could not register the 'async_rm' reward manager")
            return False
        _registered = True
        return True


class _LoaderProxy(importlib.abc.Loader):
    """Runs the real loader, then the registration."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register_reward_manager()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """One-shot finder: wraps the loader of :data:`REGISTRY_MODULE`, then removes itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != REGISTRY_MODULE:
            return None
        _remove_hook()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderProxy(spec.loader)
                return spec
        return None


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportHook)]


def _install() -> None:
    if REGISTRY_MODULE in sys.modules:
        register_reward_manager()
    elif not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())


try:
    _install()
except Exception:  # never break `import verl`
    logger.exception("verl_async_rm: could not install the reward-manager registration hook")
