"""Entry point of the ``verl.plugins`` group, imported on ``import verl`` in every process: cheap, never raises.

Three things happen here, each when the verl module it needs is imported (:func:`after_import`), not before:

- the ``async_rm`` reward manager is registered when verl's reward-manager registry is imported (importing that stack
  eagerly would roughly double the time of ``import verl`` in every process);
- on a machine without an accelerator, verl's CPU platform and its workarounds are activated
  (:mod:`verl_async_rm.cpu_platform`) when verl's platform registry is imported, which ``import verl`` does before it
  loads this entry point; on a machine with one, nothing changes;
- verl's ``validate_config``, which verl's ``main_ppo`` calls before it starts Ray and the policy's workers, also runs
  the plugin's config checks for a run that opts in (:func:`check_config_first`): a bad ``async_rm`` key fails in
  seconds, not after the policy's workers have loaded.

A failure is logged (verl would only say ``Unknown reward manager: async_rm``, or fall back to its nvidia platform).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_MODULE", "PLATFORM_MODULE", "REGISTRY_MODULE", "after_import", "check_config_first", "pending_hooks",
           "register_reward_manager"]

#: verl's reward-manager package; importing it registers verl's own managers.
REGISTRY_MODULE = "verl.experimental.reward_loop.reward_manager"
#: verl's platform registry (``PlatformRegistry``), imported by ``verl.utils.device`` early in ``import verl``.
PLATFORM_MODULE = "verl.plugin.platform"
#: verl's ``validate_config``, which verl's ``main_ppo`` calls (and binds by name) before ``run_ppo``.
CONFIG_MODULE = "verl.utils.config"

_lock = threading.RLock()
_registered = False
#: module name -> callbacks to run once it is imported
_hooks: dict[str, list[Callable[[Any], None]]] = {}


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


def after_import(name: str, fn: Callable[[Any], None]) -> None:
    """Run ``fn(module)`` once module ``name`` has been imported: now if it is already, else right after its import
    (a one-shot wrapper of its loader, through :class:`_PostImportHook` on ``sys.meta_path``). ``fn``'s errors are
    logged, never raised into the import."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(fn)
            if not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
                sys.meta_path.insert(0, _PostImportHook())
            return
    _run(name, module, [fn])


def pending_hooks() -> list[str]:
    """The modules whose import is still awaited by a hook."""
    with _lock:
        return sorted(_hooks)


def _run(name: str, module: Any, callbacks: list[Callable[[Any], None]]) -> None:
    for fn in callbacks:
        try:
            fn(module)
        except Exception:  # never break an import
            logger.exception("verl_async_rm: a hook on the import of %s failed", name)


class _LoaderProxy(importlib.abc.Loader):
    """Runs the real loader, then the module's hooks."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _lock:
            callbacks = _hooks.pop(self._name, [])
            if not _hooks:  # the last awaited import: the finder goes
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportHook)]
        _run(self._name, module, callbacks)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module a hook waits for; removes itself once none is left."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find_spec(fullname, path, target) if find_spec else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderProxy(spec.loader, fullname)
                return spec
        return None


def check_config_first(config_module: Any) -> None:
    """Wrap ``config_module.validate_config`` (verl's) so that, after verl's own checks, a config that opts into the
    plugin (its agent-loop manager or the ``async_rm`` reward manager) gets the plugin's checks too
    (:func:`verl_async_rm.integration.checks.check_verl_config`); other configs are untouched. verl's ``main_ppo``
    imports the name after this hook has run, so it calls the wrapper."""
    validate = config_module.validate_config
    if getattr(validate, "async_rm_checks", False):
        return

    @functools.wraps(validate)
    def validate_config(config: Any, *args: Any, **kwargs: Any) -> Any:
        result = validate(config, *args, **kwargs)
        if _opts_in(config):
            from verl_async_rm.integration.checks import check_verl_config, probe_endpoints

            probe_endpoints(check_verl_config(config))
        return result

    validate_config.async_rm_checks = True  # type: ignore[attr-defined]
    config_module.validate_config = validate_config


def _opts_in(config: Any) -> bool:
    """The run uses the ``async_rm`` reward manager or the plugin's agent-loop manager (a subclass of it counts: the
    demo's timed one). Another class of this package is not an opt-in: the demo's modes without the plugin run verl's
    own manager, timed, as ``verl_async_rm.demo.v0_timing.TimedAgentLoopManager``."""
    from verl_async_rm.options import select

    if select(config, "reward.reward_manager.name") == "async_rm":
        return True
    path = str(select(config, "actor_rollout_ref.rollout.agent.agent_loop_manager_class") or "")
    if not path.startswith("verl_async_rm."):
        return False
    from verl_async_rm.integration.agent_loop_manager import AsyncRMAgentLoopManager
    from verl_async_rm.integration.manager_base import AsyncRMManagerBase

    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)  # verl imports it next; a wrong name: verl says so
    return isinstance(cls, type) and issubclass(cls, (AsyncRMAgentLoopManager, AsyncRMManagerBase))


try:
    after_import(REGISTRY_MODULE, lambda _module: register_reward_manager())
    after_import(PLATFORM_MODULE,
                 lambda _module: importlib.import_module("verl_async_rm.cpu_platform").activate(after_import))
    after_import(CONFIG_MODULE, check_config_first)
except Exception:  # never break `import verl`
    logger.exception("verl_async_rm: could not install the plugin's import hooks")
