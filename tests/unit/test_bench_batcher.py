"""`verl-async-rm bench batcher --quick` runs and writes its JSON (a smoke test; timings are not asserted)."""

from __future__ import annotations

import json

import pytest

from verl_async_rm.cli import main as cli_main

pytestmark = pytest.mark.unit


def test_quick_bench_writes_the_report(tmp_path, capsys):
    assert cli_main(["bench", "batcher", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "batcher.json").read_text())
    assert report["benchmark"] == "batcher" and report["machine"]["cpus"] >= 1
    assert {"overhead", "saturation", "lone"} <= set(report["results"])
    assert report["results"]["saturation"]["mean_fill"] > 0
    assert set(report["targets_met"]) and all(isinstance(v, bool) for v in report["targets_met"].values())
    assert f"wrote {tmp_path / 'batcher.json'}" in capsys.readouterr().out
