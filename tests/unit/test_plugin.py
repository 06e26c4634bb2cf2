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


def test_import_verl_loads_the_plugin():
    out = _run("import sys, verl; print('verl_async_rm.plugin' in sys.modules)")
    assert out.splitlines()[-1] == "True"


def test_verl_policy_none_disables_it():
    out = _run("import sys, verl; print('verl_async_rm.plugin' in sys.modules)", VERL_USE_EXTERNAL_PLUGINS="none")
    assert out.splitlines()[-1] == "False"


def test_loading_the_plugin_imports_nothing_heavy():
    out = _run(
        "import sys, verl_async_rm.plugin; print(sorted(m for m in ('torch', 'ray', 'transformers', 'verl') "
        "if m in sys.modules))"
    )
    assert out.splitlines()[-1] == "[]"
