"""``scripts/gpu_check.sh``, the one command run on a lent GPU machine, rehearsed on this CPU machine: every stage runs
(the benchmarks on the tiny shape, ``tests/gpu`` collected and skipped) and the figures land in ``$OUT`` as JSON, so
that on the GPU only the GPU itself is new."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_rehearses_every_stage_on_cpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real check, not the rehearsal")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_CHECK_BUDGET_S": "400"}
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["environment"]["cuda_available"] is False
    stages = summary["stages"]
    assert list(stages) == ["verl_platform", "bench_rm_8b", "tests_gpu_rm", "bench_rm_0p5b", "tests_gpu_colocation",
                            "done"]
    assert all(stage["status"] == "ok" for stage in stages.values()), stages
    assert stages["verl_platform"]["seen"]["plugin_loaded"] is True
    assert stages["verl_platform"]["unchanged_on_gpu"] is None  # only a CUDA machine can say
    seen = stages["verl_platform"]["seen"]
    assert (seen["device_name"], seen["backend"], seen["cpu_platform"]) == ("cpu", "gloo", True)
    report = stages["bench_rm_8b"]["report"]
    assert set(report["modes"]) == {"auto", "auto+shared", "false"}  # --rollout-n 8: the shared-prompt mode ran
    for name in ("tests_gpu_rm", "tests_gpu_colocation"):
        junit = (tmp_path / f"{name}.xml").read_text()
        assert 'skipped="' in junit and 'errors="0"' in junit and 'failures="0"' in junit
    assert "gpu_check: 5 stages" in (tmp_path / "gpu_check.log").read_text()
