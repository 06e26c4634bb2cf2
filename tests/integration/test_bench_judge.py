"""``verl-async-rm bench judge`` runs both readouts of a judge on one causal LM (the generate one on real vLLM) and
reports what it measured. A measurement, never a bound: only the report's shape and counts are checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import require_vllm

pytestmark = pytest.mark.integration


def test_bench_judge_reports_both_readouts(tmp_path):
    require_vllm()
    proc = subprocess.run(
        [sys.executable, "-m", "verl_async_rm", "bench", "judge", "--requests", "8", "--max-tokens", "3",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_judge.json").read_text())
    logits, generate = report["modes"]
    assert (logits["mode"], generate["mode"]) == ("logits", "generate:3")
    assert logits["failed"] == 0 and logits["generated_tokens"] is None
    assert 8 <= generate["generated_tokens"] <= 8 * 3  # at least one token each, at most the budget
    assert generate["failed"] == generate["parse_failures"]  # a random judge's verdicts may not parse: nothing else
    assert all(row["trajectories_per_s"] > 0 for row in report["modes"])
    assert "| generate:3 |" in proc.stdout
