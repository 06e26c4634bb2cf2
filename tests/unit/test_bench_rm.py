"""``verl-async-rm bench rm`` on the CPU with the tiny shape: the report's keys, and packed scores equal padded ones.

No timing is asserted (timings belong to the benchmark's report, not to a unit test).
"""

from __future__ import annotations

import json

import pytest

from verl_async_rm.bench.rm import main
from verl_async_rm.bench.rm_model import SHAPES, rl_workload
from verl_async_rm.cli import main as cli_main

pytestmark = pytest.mark.unit

MODE_KEYS = {
    "packing", "packing_reason", "forwards", "real_tokens", "padded_tokens", "padding_fraction", "fresh_s",
    "repeat_s", "fresh_tok_per_s", "repeat_tok_per_s", "fresh_over_repeat", "fresh_of_dense_bound",
    "repeat_of_dense_bound", "fresh_mfu", "repeat_mfu", "peak_memory_gib", "peak_memory_kind", "failed",
    "share_prompts", "computed_over_real", "fresh_traj_per_s",
}


def test_tiny_cpu_run_reports_every_figure_and_equal_scores(tmp_path, capsys):
    status = cli_main(["bench", "rm", "--shape", "tiny", "--device", "cpu", "--requests", "48",
                       "--out", str(tmp_path)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "dense bound" in printed and "packed (varlen: row_padded_sdpa)" in printed
    report = json.loads((tmp_path / "bench_rm.json").read_text())
    assert {"environment", "shape", "device", "dtype", "n_params", "peak_flops", "budget", "workload", "dense_bound",
            "modes", "scores"} <= set(report)
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["peak_flops"] is None
    assert report["dense_bound"]["tok_per_s"] > 0 and report["dense_bound"]["mfu"] is None
    assert set(report["modes"]) == {"auto", "false"}
    for mode in report["modes"].values():
        assert set(mode) == MODE_KEYS
        assert mode["failed"] == 0 and mode["real_tokens"] == report["workload"]["real_tokens"]
        assert mode["fresh_tok_per_s"] > 0 and mode["repeat_tok_per_s"] > 0 and mode["fresh_mfu"] is None
    packed, padded = report["modes"]["auto"], report["modes"]["false"]
    assert packed["padding_fraction"] == 0 and packed["padded_tokens"] == packed["real_tokens"]
    assert padded["packing"] == "padded" and padded["padded_tokens"] >= padded["real_tokens"]
    assert report["scores"]["max_abs_diff"]["auto vs false"] < 1e-4
    assert report["scores"]["std"] > 1e-3  # the scores differ between inputs, so equal scores mean something


def test_grpo_workload_shares_prompts_and_scores_stay_equal(tmp_path):
    status, _ = main(["--shape", "tiny", "--device", "cpu", "--requests", "64", "--rollout-n", "8",
                      "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench_rm.json").read_text())
    assert status == 0 and list(report["modes"]) == ["auto", "auto+shared", "false"]
    shared, plain = report["modes"]["auto+shared"], report["modes"]["auto"]
    assert shared["share_prompts"] is True and plain["share_prompts"] is False
    assert shared["computed_over_real"] < 0.9 and plain["computed_over_real"] == 1
    assert max(report["scores"]["max_abs_diff"].values()) < 1e-4


def test_workload_is_seeded_and_scaled():
    (a, _), (b, _) = rl_workload(64, 3, vocab=640, scale=16), rl_workload(64, 3, vocab=640, scale=16)
    assert a == b and a != rl_workload(64, 4, vocab=640, scale=16)[0]
    rows, groups = rl_workload(16, 0, vocab=640, rollout_n=8)
    assert groups[:8] == [groups[0]] * 8 and groups[8] != groups[0]
    assert all(r[:64] == rows[0][:64] for r in rows[:8]) and rows[8][:64] != rows[0][:64]
    full, _ = rl_workload(256, 0, vocab=10**6)
    lengths = sorted(len(r) for r in full)
    assert 64 + 16 <= lengths[0] and lengths[-1] <= 512 + 4096
    assert 500 < lengths[len(lengths) // 2] < 1100  # prompt ~288 + response median ~400
    assert all(3 <= t < 32000 for r in full for t in r)


def test_public_shapes_and_bad_arguments():
    assert {"llama8b", "qwen0.5b", "tiny"} <= set(SHAPES)
    assert SHAPES["llama8b"]["hidden_size"] == 4096 and SHAPES["qwen0.5b"]["num_key_value_heads"] == 2
    status, text = main(["--shape", "gpt5", "--device", "cpu"])
    assert status == 2 and "--shape 'gpt5': unknown" in text and "Fix" in text
    status, text = main(["--packing", "sometimes", "--device", "cpu"])
    assert status == 2 and "--packing 'sometimes'" in text


def test_a_config_json_gives_the_shape(tmp_path):
    config = dict(SHAPES["tiny"], model_type="llama", num_key_value_heads=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    status, _ = main(["--config", str(tmp_path), "--device", "cpu", "--requests", "8", "--packing", "true",
                      "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "bench_rm.json").read_text())
    assert status == 0 and report["shape"].endswith("config.json") and list(report["modes"]) == ["true"]


def test_runs_where_verl_ray_and_omegaconf_are_not_installed(tmp_path):
    """The GPU machines have torch and transformers only: the command must not import verl, Ray or omegaconf."""
    import subprocess
    import sys

    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('verl', 'ray', 'omegaconf', 'hydra'):\n"
        "            raise ImportError(f'{name} is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from verl_async_rm.cli import main\n"
        f"sys.exit(main(['bench', 'rm', '--device', 'cpu', '--requests', '8', '--out', {str(tmp_path)!r}]))\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads((tmp_path / "bench_rm.json").read_text())["modes"]["auto"]["failed"] == 0


@pytest.mark.parametrize("sharding", ["tensor_parallel", "fsdp2"])
def test_the_sharded_load_path_on_one_rank_scores_as_the_plain_model(tmp_path, sharding):
    reports = {}
    for name in ("none", sharding):
        status, _ = main(["--shape", "tiny", "--device", "cpu", "--requests", "16", "--packing", "false",
                          "--sharding", name, "--out", str(tmp_path / name)])
        assert status == 0
        reports[name] = json.loads((tmp_path / name / "bench_rm.json").read_text())
    assert reports[sharding]["sharding"] == sharding and reports["none"]["sharding"] == "none"
    assert reports[sharding]["scores"]["first"] == pytest.approx(reports["none"]["scores"]["first"], abs=1e-5)
    assert reports[sharding]["modes"]["false"]["failed"] == 0
