"""``verl-async-rm bench pairwise``: a simulated judge (labelled so), deterministic by its seed, a row per judge and
group size; with no noise and no bias every all_pairs mode ranks each group exactly; its Kendall tau-b by hand."""

from __future__ import annotations

import json
import re

import pytest

from verl_async_rm.bench.pairwise import MODES, kendall_tau_b, main
from verl_async_rm.cli import main as cli_main

pytestmark = pytest.mark.unit

SMALL = ["--groups", "6", "--sizes", "4,8"]


def rows(table: str) -> dict[tuple[str, str], list[str]]:
    """``(n, judge) -> cells`` of the table's rows."""
    found = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdecimal():
            found[cells[0], cells[1]] = cells[2:]
    return found


def test_a_small_run_is_labelled_simulated_deterministic_and_has_every_row():
    status, table = main(SMALL)
    assert status == 0 and table.splitlines()[0] == "simulated judge: no model runs"
    assert main(SMALL) == (status, table)
    assert main([*SMALL, "--seed", "1"])[1] != table
    found = rows(table)
    assert set(found) == {(n, name) for n in ("4", "8") for name, *_ in MODES} and len(found) == 2 * len(MODES)
    calls = {judge: float(cells[0]) for (n, judge), cells in found.items() if n == "8"}
    assert calls["per_response"] == 1.0 and calls["group"] == 0.125
    assert calls["pairwise all_pairs both win_rate"] == 7.0 and calls["pairwise all_pairs one win_rate"] == 3.5
    assert calls["pairwise circular both win_rate"] == 2.0 and calls["pairwise circular one win_rate"] == 1.0
    assert "goals (issue 65):" in table  # n = 8 is among the sizes, at the error rate and bias


def test_with_no_noise_and_no_bias_all_pairs_ranks_every_group_exactly():
    report = json.loads(main(["--groups", "5", "--error-rate", "0", "--position-bias", "0", "--json"])[1])
    assert report["simulated"] is True and set(report["sizes"]) == {"4", "8", "16"}
    for figures in report["sizes"].values():
        for name, row in figures.items():
            if row["plan"] == "all_pairs" or row["judge"] != "pairwise":
                assert (name, row["tau_mean"], row["wrong_share"]) == (name, 1.0, 0.0)
            assert row["position_flip_rate"] in (None, 0.0)


def test_the_flip_rate_reads_the_injected_bias():
    report = json.loads(main(["--groups", "50", "--sizes", "8", "--error-rate", "0", "--json"])[1])
    best = report["sizes"]["8"]["pairwise all_pairs both win_rate"]
    assert best["position_flip_rate"] == pytest.approx(0.15, abs=0.03)
    assert report["sizes"]["8"]["pairwise all_pairs one win_rate"]["position_flip_rate"] is None


def test_out_writes_the_report_and_the_cli_runs_it(tmp_path, capsys):
    status, table = main([*SMALL, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench_pairwise.json").read_text())
    assert report["bench"] == "pairwise" and report["groups"] == 6 and len(report["goals"]) == 4
    assert cli_main(["bench", "pairwise", *SMALL]) == 0
    assert capsys.readouterr().out.strip() == table


@pytest.mark.parametrize(("argv", "words"), [
    (["--sizes", "4,x"], "comma-separated integers"),
    (["--sizes", "1"], "at least 2 responses"),
    (["--error-rate", "0.5"], r"\[0, 0.5\)"),
    (["--position-bias", "1"], r"\[0, 1\)"),
    (["--groups", "0"], "at least 1 group"),
])
def test_bad_settings_say_what_to_pass(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(words, capsys.readouterr().err)


def test_kendall_tau_b_by_hand():
    assert kendall_tau_b([1, 2, 3], [10, 20, 30]) == 1.0 and kendall_tau_b([3, 2, 1], [10, 20, 30]) == -1.0
    # x ties its first two: C = 2 (pairs 0-2, 1-2), D = 0, Tx = 1 -> 2 / sqrt(3 * 2)
    assert kendall_tau_b([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 6 ** 0.5)
    assert kendall_tau_b([0.5, 0.5], [1, 2]) == 0.0
