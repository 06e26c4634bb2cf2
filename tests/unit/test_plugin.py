"""verl finds the plugin through the ``verl.plugins`` entry point, and loading it is cheap."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.unit


def _run(code: str, **env) -> str:
    import os

    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=full_env, timeout=120
    ).stdout.strip()


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("async_rm") == "verl_async_rm.plugin"


# --- what a process that imports verl loads: two subprocesses (each pays verl's import) serve the tests below -------

_AUTO = """
import json, sys
import verl
seen = {"plugin_loaded_by_verl": "verl_async_rm.plugin" in sys.modules}
from verl_async_rm import plugin

def hooks():
    return {"finders": [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "verl_async_rm.plugin"],
            "waiting_for": plugin.pending_hooks()}

seen["after_import_verl"] = {
    "manager_imported": "verl_async_rm.integration.reward_manager" in sys.modules, **hooks(),
}
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
cls = get_reward_manager_cls("async_rm")
from verl_async_rm.integration.reward_manager import AsyncRMRewardManager
seen["after_registry"] = {"is_plugin_class": cls is AsyncRMRewardManager, **hooks()}
import verl_async_rm.integration.agent_loop_manager
tools = ("matplotlib", "verl_async_rm.demo", "verl_async_rm.bench", "verl_async_rm.testing")
seen["tools"] = sorted(m for m in sys.modules if m.startswith(tools))  # before the hooks' own imports below
for name in list(plugin.pending_hooks()):  # what the CPU platform's workarounds wait for (none on a GPU machine)
    __import__(name)
seen["after_all"] = hooks()
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl_async_rm.integration import trainer_hooks
seen["v1_trainer"] = {"hooks_installed": trainer_hooks.installed(),
                      "step_wrapped": hasattr(PPOTrainer.step, "__async_rm_wrapped__")}
print(json.dumps(seen))
"""

_NONE = """
import json, sys
import verl
seen = {"plugin_loaded_by_verl": "verl_async_rm.plugin" in sys.modules}
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
import verl_async_rm.plugin
seen["registered"] = get_reward_manager_cls("async_rm").__name__
seen["still_waiting"] = "verl.experimental.reward_loop.reward_manager" in verl_async_rm.plugin.pending_hooks()
print(json.dumps(seen))
"""


def _seen(code: str, **env) -> dict:
    import json

    return json.loads(_run(code, **env).splitlines()[-1])


@pytest.fixture(scope="module")
def hook_sequence():
    """``import verl`` with verl's default plugin policy, then verl's reward-manager registry, then the manager, then
    verl's v1 trainer."""
    return _seen(_AUTO)


@pytest.fixture(scope="module")
def plugins_off():
    """``import verl`` with ``VERL_USE_EXTERNAL_PLUGINS=none``, verl's registry, then the plugin by hand."""
    return _seen(_NONE, VERL_USE_EXTERNAL_PLUGINS="none")


def test_import_verl_loads_the_plugin(hook_sequence):
    assert hook_sequence["plugin_loaded_by_verl"] is True


def test_verl_policy_none_disables_it(plugins_off):
    assert plugins_off["plugin_loaded_by_verl"] is False


def test_loading_the_plugin_imports_nothing_heavy():
    out = _run(
        "import sys, verl_async_rm.plugin; print(sorted(m for m in ('torch', 'ray', 'transformers', 'verl') "
        "if m in sys.modules))"
    )
    assert out.splitlines()[-1] == "[]"


# --- the reward manager is registered lazily, by a one-shot post-import hook ----------------------------------------


def test_import_verl_does_not_import_the_reward_manager(hook_sequence):
    seen = hook_sequence["after_import_verl"]
    assert seen["manager_imported"] is False and seen["finders"] == ["_PostImportHook"]
    assert "verl.experimental.reward_loop.reward_manager" in seen["waiting_for"]


def test_importing_verls_registry_registers_async_rm(hook_sequence):
    assert hook_sequence["after_registry"]["is_plugin_class"] is True


def test_each_hook_fires_once_and_the_finder_goes_with_the_last(hook_sequence):
    assert "verl.experimental.reward_loop.reward_manager" not in hook_sequence["after_registry"]["waiting_for"]
    assert hook_sequence["after_all"] == {"finders": [], "waiting_for": []}


def test_registry_imported_before_the_plugin_registers_at_once(plugins_off):
    assert plugins_off["registered"] == "AsyncRMRewardManager" and plugins_off["still_waiting"] is False


def test_a_trainer_process_imports_the_runtime_core_only(hook_sequence):
    """What verl loads (the plugin entry point, the manager class, the reward manager) pulls in no tool: no demo,
    benchmark or test utilities, no plotting library (the `demo` extra). tqdm is not checked: Ray and transformers
    import it themselves."""
    assert hook_sequence["tools"] == []


def test_importing_the_plugin_and_verls_trainer_wraps_nothing(hook_sequence):
    """verl's ``PPOTrainer.step`` is wrapped only when the plugin's manager is built (``trainer_hooks``), never at
    import."""
    assert hook_sequence["v1_trainer"] == {"hooks_installed": False, "step_wrapped": False}


def test_a_verl_outside_the_tested_range_is_named_with_both_versions():
    import verl_async_rm

    assert verl_async_rm.verl_version_warning("0.9.1") is None and verl_async_rm.verl_version_warning("0.9.3") is None
    message = verl_async_rm.verl_version_warning("0.10.0")
    assert "verl 0.10.0 is installed" in message and f"verl{verl_async_rm.SUPPORTED_VERL}" in message
    assert verl_async_rm.__version__ in message and "Fix: pip install" in message
    assert verl_async_rm.verl_version_warning("0.8.5") is not None
    assert verl_async_rm.verl_version_warning() is None  # the verl installed here is in the range
