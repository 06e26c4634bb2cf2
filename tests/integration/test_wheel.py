"""The release as a user installs it: ``python -m build`` makes an sdist and a wheel of this checkout; the wheel goes
into a fresh virtual environment that sees the installed verl (and its dependencies) but not this checkout; there
``import verl_async_rm``, ``verl-async-rm --help`` and the ``verl.plugins`` entry point work from the wheel's files."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import os
import re
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.integration

#: Not part of a source tree: environments, caches, build output.
_NOT_SOURCE = (".git", ".venv", ".cache", ".whl", ".gl", "site", "build", "dist", "*.egg-info", "__pycache__",
               ".pytest_cache", ".hypothesis", "out", "async_rm_demo", "bench-*")


def _run(*cmd, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the environment itself has
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, env=env, **kwargs)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("release")
    source = tmp / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    # --no-isolation: the build backend (setuptools, wheel) is the one installed here; nothing is downloaded
    _run(sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", tmp / "dist", source)
    version = re.search(r'^version = "([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.M).group(1)
    wheels, sdists = list((tmp / "dist").glob("*.whl")), list((tmp / "dist").glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1
    return tmp, version, wheels[0], sdists[0]


def test_the_wheel_and_sdist_carry_the_runtime_the_types_and_the_entry_point(built):
    _, version, wheel, sdist = built
    assert wheel.name == f"verl_async_rm-{version}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("__init__.py", "plugin.py", "cpu_platform.py", "py.typed", "integration/agent_loop_manager.py",
                   "service/batcher.py", "scoring/scorer.py", "demo/run.py", "testing/models.py"):
        assert f"verl_async_rm/{module}" in names, module
    assert not any(n.startswith(("tests/", "docs/", "recipes/")) for n in names)
    entry_points = zipfile.ZipFile(wheel).read(f"verl_async_rm-{version}.dist-info/entry_points.txt").decode()
    assert "[verl.plugins]\nasync_rm = verl_async_rm.plugin" in entry_points
    assert "verl-async-rm = verl_async_rm.cli:main" in entry_points
    assert f"verl_async_rm-{version}.dist-info/licenses/LICENSE" in names
    members = tarfile.open(sdist).getnames()
    assert f"verl_async_rm-{version}/verl_async_rm/py.typed" in members


def test_the_wheel_installs_next_to_verl_and_plugs_into_it(built):
    tmp, version, wheel, _ = built
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python, cli = venv / "bin" / "python", venv / "bin" / "verl-async-rm"
    # next to the installed verl: this interpreter's site-packages (verl, Ray, torch...) after the new venv's own
    own = Path(_run(python, "-c", "import site; print(site.getsitepackages()[0])").stdout.strip())
    (own / "installed_verl.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", wheel)
    outside = {"cwd": tmp}  # not the checkout, so its files cannot be imported by accident

    where = _run(python, "-c", "import verl_async_rm as m; print(m.__file__); print(m.__version__)", **outside)
    file, installed = where.stdout.split()
    assert Path(file).is_relative_to(own) and installed == version

    help_text = _run(cli, "--help", **outside).stdout
    assert "demo" in help_text and "bench" in help_text

    plugged = _run(python, "-c", (
        "from importlib.metadata import entry_points\n"
        "ep = entry_points(group='verl.plugins')['async_rm']\n"
        "import verl, sys\n"  # verl imports every verl.plugins entry point
        "print(ep.value, ep.dist.version, sys.modules['verl_async_rm.plugin'].__file__)"), **outside)
    value, dist_version, plugin_file = plugged.stdout.split()[-3:]
    assert value == "verl_async_rm.plugin" and dist_version == version and Path(plugin_file).is_relative_to(own)
