"""Everything the plugin uses of verl (``verl_async_rm.touch_points``) holds on the installed verl: one test per touch
point, with the check's own message (the touch point, what verl has now, the plugin's files) when it does not.

Also: a verl changed the ways the checks are there to catch (by editing the source they read, or the reference
config: verl's ``neo`` branch and open pull requests) is named; a verl whose ``verl.trainer.ppo.v1`` cannot be
imported gets its v1 points reported ``v1 not importable`` by the doctor, not a crash (a subprocess, started with the
module so that its ``import verl`` overlaps the checks here); ``verl-async-rm doctor`` says OK on this machine; the
table of ``docs/versions.md`` is what the list renders.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from verl_async_rm import touch_points
from verl_async_rm.touch_points import TOUCH_POINTS, Result, check

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
POINTS = {p.id: p for p in TOUCH_POINTS}
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"

#: The doctor in a process where importing ``verl.trainer.ppo.v1`` fails, as it does on verl's neo branch.
_HIDDEN_V1 = """
import importlib.abc, sys

class HideV1(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "verl.trainer.ppo.v1" or name.startswith("verl.trainer.ppo.v1."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None

sys.meta_path.insert(0, HideV1())
from verl_async_rm.cli import main
sys.exit(main(["doctor"]))
"""


@pytest.fixture(scope="module", autouse=True)
def hidden_v1_doctor():
    """The hidden-v1 doctor's process, started before this module's first test and read by the last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", _HIDDEN_V1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=REPO_ROOT)
    yield process
    if process.poll() is None:
        process.kill()
        process.communicate()


@pytest.mark.parametrize("point", TOUCH_POINTS, ids=lambda p: p.id)
def test_the_installed_verl_has_it(point):
    result = check(point)
    assert result.status == "ok", result.message


def test_each_touch_point_is_described():
    assert len(POINTS) == len(TOUCH_POINTS), "two touch points share an id"
    package = REPO_ROOT / "verl_async_rm"
    for p in TOUCH_POINTS:
        assert p.group in ("core", "v1", "vllm") and p.symbol and p.relies_on and p.files, p.id
        missing = [f for f in p.files if not (package / f).is_file() and not (REPO_ROOT / f).is_file()]
        assert missing == [], p.id


# --- a changed verl is named --------------------------------------------------------------------------------------


def _edited(monkeypatch, module: str, old: str, new: str) -> None:
    """The checks read ``module``'s source with ``old`` replaced by ``new`` (verl's file is not touched)."""
    path, tree = touch_points._source(module)
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{old!r} is not in {path}: has verl changed? Update this test"
    edited = ast.parse(text.replace(old, new))
    real = touch_points._source
    monkeypatch.setattr(touch_points, "_source", lambda name: (path, edited) if name == module else real(name))


def test_a_lost_preset_worker_class_is_named_with_the_plugin_file(monkeypatch):
    _edited(monkeypatch, AGENT_LOOP, 'if not hasattr(self, "agent_loop_workers_class"):',
            "if True:  # always")
    result = check(POINTS["manager-init"])
    assert result.status == "changed"
    assert result.message.startswith("manager-init [") and "unconditionally" in result.message
    assert "integration/agent_loop_manager.py" in result.message


def test_a_renamed_keyword_at_a_compute_score_call_is_named(monkeypatch):
    _edited(monkeypatch, AGENT_LOOP, "self._compute_score([output], kwargs=kwargs)",
            "self._compute_score([output], inputs=kwargs)")
    result = check(POINTS["worker-compute-score"])
    assert result.status == "changed" and "inputs=kwargs" in result.message and "line " in result.message
    assert "integration/agent_loop_worker.py" in result.message


def test_verl_pr_7217s_validate_flag_still_binds(monkeypatch):
    """PR #7217: ``_compute_score(self, outputs, kwargs, validate)`` (required), called with ``validate=`` by keyword:
    the override takes it and passes it on."""
    _edited(monkeypatch, AGENT_LOOP, "self._compute_score([output], kwargs=kwargs)",
            "self._compute_score([output], kwargs=kwargs, validate=validate)")

    async def _compute_score(self, outputs, kwargs, validate):
        """verl's method as PR #7217 has it."""

    real = touch_points._get
    monkeypatch.setattr(touch_points, "_get", lambda path: _compute_score
                        if path.endswith("AgentLoopWorker._compute_score") else real(path))
    assert check(POINTS["worker-compute-score"]).status == "ok"
    assert check(POINTS["worker-postprocess"]).status == "ok"


def test_a_caller_passing_max_colocate_count_is_named(monkeypatch):
    """PR #7307 passes ``max_colocate_count`` to ``ResourcePoolManager``: the class default no longer tells."""
    _edited(monkeypatch, "verl.trainer.main_ppo_v0", "mapping=self.mapping)",
            "mapping=self.mapping, max_colocate_count=4)")
    result = check(POINTS["colocate-count"])
    assert result.status == "changed" and "max_colocate_count" in result.detail and "line" in result.detail


def test_neos_config_is_named_key_by_key(monkeypatch):
    """verl's neo branch: ``trainer.use_v1`` defaults to false and the ``transfer_queue`` group is gone."""
    from omegaconf import OmegaConf

    config = OmegaConf.create(OmegaConf.to_container(touch_points._reference_config()))
    config.trainer.use_v1 = False
    del config["transfer_queue"]
    monkeypatch.setattr(touch_points, "_reference_config", lambda: config)
    trainer, queue = check(POINTS["config-trainer"]), check(POINTS["config-transfer-queue"])
    assert trainer.status == queue.status == "changed"
    assert "trainer.use_v1: False (relied on: True)" in trainer.detail
    assert "transfer_queue.enable: absent (relied on: False)" in queue.detail
    assert "testing/trainer_config.py" in queue.message


def test_neos_data_plane_is_accepted_and_an_unknown_one_named(monkeypatch):
    """verl 0.9.1 has no ``trainer.data_plane``; ``neo`` adds it (``classic`` default, ``neoproto`` the default after
    PR #7557): both keep the whole-column writes of the v0 manager. A value the plugin does not know is named."""
    from omegaconf import OmegaConf

    assert OmegaConf.select(touch_points._reference_config(), "trainer.data_plane", default=None) is None
    for plane, status in (("classic", "ok"), ("neoproto", "ok"), ("arrow", "changed")):
        config = OmegaConf.create(OmegaConf.to_container(touch_points._reference_config()))
        config.trainer.data_plane = plane
        monkeypatch.setattr(touch_points, "_reference_config", lambda config=config: config)
        result = check(POINTS["config-data-plane"])
        assert result.status == status, result.message
    assert "trainer.data_plane: 'arrow'" in result.detail and "integration/drops.py" in result.message


# --- the doctor ---------------------------------------------------------------------------------------------------


def test_the_doctor_says_ok_on_this_verl(capsys):
    from verl_async_rm.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in out[:7]]
    assert names == ["verl-async-rm", "Python", "verl", "Ray", "torch", "transformers", "vLLM"]
    assert out[-1] == f"all {len(TOUCH_POINTS)} touch points OK on verl {metadata.version('verl')}"


def test_the_doctor_names_a_changed_touch_point_and_fails():
    from verl_async_rm.doctor import report

    point = POINTS["validate-config"]
    status, text = report([Result(point, "changed", "validate_config(cfg)"), Result(POINTS["main-ppo"], "ok")])
    lines = text.splitlines()
    assert status == 1 and lines[-1] == "1 of 2 touch points changed: validate-config"
    assert lines[-2] == (f"validate-config [{point.symbol}]: verl now has validate_config(cfg); relied on by "
                         f"plugin.py: {point.relies_on}")


def test_without_an_importable_v1_the_doctor_reports_it_and_passes(hidden_v1_doctor):
    out, err = hidden_v1_doctor.communicate(timeout=300)
    assert hidden_v1_doctor.returncode == 0, f"{out}\n{err}"
    assert "Traceback" not in err, err
    v1 = [p.id for p in TOUCH_POINTS if p.group == "v1"]
    skipped = next(line for line in out.splitlines() if line.startswith("not checked, v1 not importable ("))
    assert skipped.endswith(": " + ", ".join(v1)) and "hidden by the test" in skipped
    assert out.splitlines()[-1] == (f"all {len(TOUCH_POINTS) - len(v1)} of {len(TOUCH_POINTS)} touch points checked "
                                    f"OK on verl {metadata.version('verl')}; {len(v1)} not checked (v1 not importable)")


# --- the docs -----------------------------------------------------------------------------------------------------


def _generator():
    spec = importlib.util.spec_from_file_location("gen_touch_points", REPO_ROOT / "docs/hooks/gen_touch_points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_versions_page_holds_the_table_the_list_renders():
    generator = _generator()
    assert generator.is_current(), f"docs/versions.md's touch-point table is stale: run {generator.REGENERATE}"
    page = generator.PAGE.read_text(encoding="utf-8")
    assert f"all {len(TOUCH_POINTS)} touch points OK on verl" in page, "update the doctor's example output"
    assert all(f"| `{p.id}`" in page for p in TOUCH_POINTS)
