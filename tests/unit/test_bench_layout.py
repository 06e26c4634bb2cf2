"""``verl-async-rm bench layout``: the layout model on hand-worked cases, its properties over many inputs, the CLI's
JSON and its errors, and the preset's table in ``docs/benchmarks.md``.

Every figure here is the model's arithmetic (no clock): nothing is timed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async_rm.bench.layout import (
    DEFAULT_PRESET,
    PRESETS,
    LayoutInputs,
    compare_layouts,
    dense_parameters,
    main,
    run_layout_bench,
    simulate_rollout,
)
from verl_async_rm.bench.rm_model import SHAPES
from verl_async_rm.bench.workload import Workload

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESET = LayoutInputs(**{name: value for name, (value, _) in PRESETS[DEFAULT_PRESET].items()})
FREE_RM = {"rm_tok_s": math.inf, "rm_call_ms": 0.0, "rm_weight_gb": 0.0}


def _hand_inputs(**changes) -> LayoutInputs:
    """2 GPUs, 100 tokens/s everywhere, saturation at one sequence: every rate in the hand-worked cases is 100 or 50."""
    base = dataclasses.replace(
        PRESET, gpus_per_node=2, dedicated=(1,), trajectories=2, policy_prefill_tok_s=100.0, decode_tok_s=100.0,
        saturation_batch=1.0, update_s=1.0, rm_tok_s=100.0, rm_call_ms=0.0, rm_weight_gb=0.0,
        share_slowdown=0.5, share_slowdown_tail=0.5,
    )
    return dataclasses.replace(base, **changes)


#: Two trajectories: prompts of 100 tokens, responses of 100 and 300: RM work 2 s and 4 s at 100 tokens/s.
HAND = Workload(finish_s=(0.0, 0.0), prompt_tokens=(100, 100), response_tokens=(100, 300))


def test_hand_worked_step_of_every_layout():
    # prefill 200 / (2 x 100) = 1 s on 2 GPUs; both decode at min(100 x 2 / 2, 100 / 1) = 100: the first is done at 2,
    # the second at 4 (no-rm, colocated-after). overlapped: at 2 the first's 2 s of RM work is 1 s per GPU; the decode
    # beside it runs at 50 for 1 s (to 150 of 300), then at 100: done at 4.5; tail = max(4 / 2, 4) = 4.
    # colocated-after: 4 + max(6 / 2, 4) = 8. dedicated:1: prefill 2 s on 1 GPU, both at 50: first at 4, then 100:
    # done at 6 (the 2 s of RM work drained alongside); tail 4; update 1 x 2 / 1.
    r = compare_layouts(_hand_inputs(), HAND)
    assert r["no-rm"].step_s == pytest.approx(4 + 1)
    assert r["overlapped"].rollout_s == pytest.approx(4.5)
    assert r["overlapped"].rm_tail_s == pytest.approx(4.0)
    assert r["overlapped"].step_s == pytest.approx(4.5 + 4 + 1)
    assert r["overlapped"].decode_slowed_s == pytest.approx(1.0)
    assert r["colocated-after"].rm_tail_s == pytest.approx(4.0)
    assert r["colocated-after"].step_s == pytest.approx(4 + 4 + 1)
    assert r["dedicated:1"].rollout_s == pytest.approx(6.0)
    assert (r["dedicated:1"].rm_tail_s, r["dedicated:1"].update_s) == pytest.approx((4.0, 2.0))
    assert r["dedicated:1"].step_s == pytest.approx(12.0)
    assert all(result.gpu_s == pytest.approx(2 * result.step_s) for result in r.values())


def test_hand_worked_idle_gpu_seconds():
    # no-rm: one GPU empty from 2 to 4. overlapped: one empty from 3 to 4.5 (the RM queue is empty), tail 2 x 4 with
    # 2 x 2 of RM work. colocated-after: 2 in the rollout, 2 x 4 - 6 while scoring. dedicated:1: the RM GPU waits
    # 2 s (prefill) + 2 s (to the first finish), the policy GPU the whole tail (4), the RM GPU the update (2).
    r = compare_layouts(_hand_inputs(), HAND)
    assert r["no-rm"].idle_gpu_s == pytest.approx(2.0)
    assert r["overlapped"].idle_gpu_s == pytest.approx(1.5 + 4.0)
    assert r["colocated-after"].idle_gpu_s == pytest.approx(2.0 + 2.0)
    assert r["dedicated:1"].idle_gpu_s == pytest.approx(2 + 2 + 4 + 2)


def test_sleep_wake_and_call_latency_add_where_the_layout_pays_them():
    # 15 GB over 25 GB/s: 0.6 s each way, paid by the sleeping layouts only; the call latency lands in every tail.
    plain = compare_layouts(_hand_inputs(), HAND)
    paid = compare_layouts(_hand_inputs(rm_weight_gb=15.0, host_gbps=25.0, rm_call_ms=30.0), HAND)
    for name in ("overlapped", "colocated-after"):
        assert paid[name].sleep_wake_s == pytest.approx(1.2)
        assert paid[name].step_s == pytest.approx(plain[name].step_s + 1.2 + 0.03)
    assert paid["dedicated:1"].sleep_wake_s == 0.0
    assert paid["dedicated:1"].step_s == pytest.approx(plain["dedicated:1"].step_s + 0.03)
    assert paid["no-rm"].step_s == plain["no-rm"].step_s


def test_the_share_slowdown_moves_from_the_tail_value_to_the_saturated_one():
    p = _hand_inputs(share_slowdown=0.8, share_slowdown_tail=0.2)
    assert (p.share_slowdown_at(0.0), p.share_slowdown_at(0.5), p.share_slowdown_at(1.0)) == pytest.approx(
        (0.2, 0.5, 0.8))
    assert LayoutInputs(**{**dataclasses.asdict(p), "share_slowdown_tail": None}).share_slowdown_tail == 0.8


def test_a_lone_sequence_decodes_at_t_over_s_however_many_gpus_are_free():
    one = Workload(finish_s=(0.0,), prompt_tokens=(16,), response_tokens=(1000,))
    for gpus in (1, 8):
        roll = simulate_rollout(one, [0.0], policy_gpus=gpus, rm_gpus=0, shared=False,
                                inputs=dataclasses.replace(PRESET, decode_tok_s=1000.0, saturation_batch=10.0))
        assert roll.rollout_s - roll.prefill_s == pytest.approx(1000 / (1000.0 / 10.0))
        assert roll.decode_utilisation == pytest.approx(1 / (10.0 * gpus))


def test_a_free_rm_leaves_every_layout_but_dedicated_at_the_no_rm_step():
    free = dataclasses.replace(PRESET, trajectories=256, **FREE_RM)
    r = compare_layouts(free)
    for name in ("overlapped", "colocated-after"):
        assert r[name].step_s == pytest.approx(r["no-rm"].step_s, rel=1e-12)
        assert r[name].rm_tail_s == 0.0 and r[name].sleep_wake_s == 0.0
    n = free.gpus
    for k in free.dedicated:
        fewer = compare_layouts(dataclasses.replace(free, gpus_per_node=n - k, dedicated=(),
                                                    update_s=free.update_s * n / (n - k)))["no-rm"]
        assert r[f"dedicated:{k}"].step_s == pytest.approx(fewer.step_s, rel=1e-12)
        assert r[f"dedicated:{k}"].update_s == pytest.approx(free.update_s * n / (n - k))
        assert r[f"dedicated:{k}"].step_s > r["no-rm"].step_s


def test_an_rm_far_faster_than_the_rollout_leaves_a_dedicated_tail_of_one_call():
    # The queue is empty at the last finish, so the tail is the last trajectory alone: c + w_last (~5 us of work).
    p = dataclasses.replace(PRESET, trajectories=128, rm_tok_s=1e9, rm_call_ms=30.0)
    r = compare_layouts(p)
    for k in p.dedicated:
        assert r[f"dedicated:{k}"].rm_tail_s == pytest.approx(0.030, abs=1e-5)


# Inputs drawn over wide ranges (small steps, so that the properties are checked on many shapes quickly).
_inputs = st.builds(
    lambda gpus, k, b, seed, t, s, r, sat, tail, call, w, sigma: dataclasses.replace(
        PRESET, gpus_per_node=gpus, dedicated=(min(k, gpus - 1),), trajectories=b, seed=seed, decode_tok_s=t,
        saturation_batch=s, rm_tok_s=r, share_slowdown=sat, share_slowdown_tail=tail, rm_call_ms=call,
        rm_weight_gb=w, response_sigma=sigma),
    gpus=st.integers(2, 8), k=st.integers(1, 4), b=st.integers(1, 96), seed=st.integers(0, 1000),
    t=st.sampled_from([500.0, 3000.0, 12000.0]), s=st.sampled_from([1.0, 8.0, 96.0]),
    r=st.floats(200.0, 3e5), sat=st.floats(0.0, 1.0), tail=st.floats(0.0, 1.0),
    call=st.sampled_from([0.0, 30.0]), w=st.sampled_from([0.0, 15.0]), sigma=st.sampled_from([0.3, 1.0, 2.0]),
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(p=_inputs)
def test_overlapped_is_never_faster_than_no_rm_and_colocated_after_never_faster_than_free_sharing(p):
    r = compare_layouts(p)
    assert r["overlapped"].step_s >= r["no-rm"].step_s - 1e-9
    assert r["overlapped"].rollout_s >= r["no-rm"].rollout_s - 1e-9
    free_sharing = compare_layouts(dataclasses.replace(p, share_slowdown=0.0, share_slowdown_tail=0.0))
    assert free_sharing["colocated-after"].step_s >= free_sharing["overlapped"].step_s - 1e-9
    assert free_sharing["overlapped"].rollout_s == pytest.approx(r["no-rm"].rollout_s, rel=1e-12)
    for result in r.values():
        assert result.idle_gpu_s >= -1e-9 and result.gpu_s == pytest.approx(p.gpus * result.step_s)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(p=_inputs, factor=st.floats(1.01, 20.0))
def test_every_layout_is_monotonic_in_rm_cost(p, factor):
    cheap = compare_layouts(p)
    dear = compare_layouts(dataclasses.replace(p, rm_tok_s=p.rm_tok_s / factor))
    for name, result in cheap.items():
        assert dear[name].step_s >= result.step_s * (1 - 1e-12), name


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(p=_inputs, more=st.floats(0.0, 1.0))
def test_overlapped_is_monotonic_in_the_share_slowdown(p, more):
    slower = dataclasses.replace(p, share_slowdown=p.share_slowdown + (1 - p.share_slowdown) * more,
                                 share_slowdown_tail=p.share_slowdown_tail + (1 - p.share_slowdown_tail) * more)
    assert compare_layouts(slower)["overlapped"].step_s >= compare_layouts(p)["overlapped"].step_s * (1 - 1e-12)


def test_dense_parameters_count_as_transformers_does():
    # transformers 5.10 on the meta device: AutoModelForSequenceClassification.from_config(num_labels=1)
    assert dense_parameters(SHAPES["llama8b"]) == 7_504_928_768
    assert dense_parameters(SHAPES["qwen0.5b"]) == 494_033_664
    with pytest.raises(ValueError, match="--rm-weight-gb"):
        dense_parameters({"model_type": "mixtral"})


def test_the_cli_writes_every_input_source_assumption_and_layout(tmp_path):
    status, text = main(["--trajectories", "64", "--dedicated", "1,3", "--share-slowdown", "0.3",
                         "--out", str(tmp_path)])
    assert status == 0
    report = json.loads((tmp_path / "bench_layout.json").read_text())
    assert report["kind"] == "modelled, not measured" and report["preset"] == DEFAULT_PRESET
    fields = {f.name for f in dataclasses.fields(LayoutInputs)}
    assert set(report["inputs"]) == fields and set(report["sources"]) == fields
    assert report["inputs"]["dedicated"] == [1, 3] and report["inputs"]["share_slowdown_tail"] == 0.3
    assert report["sources"]["trajectories"] == "given on the command line"
    assert report["sources"]["share_slowdown_tail"] == "= --share-slowdown"
    assert report["sources"]["rm_tok_s"].startswith("assumed")  # the H100 figure is not measured in this repository
    assert all(source.startswith(("measured", "computed", "assumed")) for name, source in report["sources"].items()
               if name not in ("trajectories", "dedicated", "share_slowdown", "share_slowdown_tail"))
    assert set(report["layouts"]) == {"no-rm", "dedicated:1", "dedicated:3", "overlapped", "colocated-after"}
    assert report["fastest"] in report["layouts"] and report["fastest"] != "no-rm"
    assert {"decode", "sharing", "rm_queue", "sleep_wake", "not_modelled"} <= set(report["assumptions"])
    assert set(report["sensitivity"]["overlapped_step_s_at_share_slowdown"]) == {"0", "0.25", "0.5", "0.75", "1"}
    assert "| overlapped |" in text and "sharing assumption" in text and "s_sat = 0.3" in text
    assert str(tmp_path / "bench_layout.json") in text


def test_the_break_even_share_slowdown_separates_winning_from_losing():
    p = dataclasses.replace(PRESET, trajectories=128, rm_tok_s=3000.0, dedicated=(2,))
    report = run_layout_bench(p, {}, DEFAULT_PRESET)
    even = report["sensitivity"]["break_even_share_slowdown"]
    assert even is not None and 0 < even < 1
    best_other = min(r["step_s"] for name, r in report["layouts"].items() if name not in ("no-rm", "overlapped"))
    at = {s: compare_layouts(dataclasses.replace(p, share_slowdown=s, share_slowdown_tail=s))["overlapped"].step_s
          for s in (even, min(1.0, even + 0.01))}
    assert at[even] <= best_other < at[min(1.0, even + 0.01)]


@pytest.mark.parametrize("argv, flag, value", [
    (["--dedicated", "8"], "--dedicated", "8"),
    (["--nodes", "1", "--gpus-per-node", "1", "--dedicated", "1"], "--dedicated", "1"),
    (["--decode-tok-s", "-5"], "--decode-tok-s", "-5.0"),
    (["--rm-tok-s", "0"], "--rm-tok-s", "0.0"),
    (["--policy-prefill-tok-s", "nan"], "--policy-prefill-tok-s", "nan"),
    (["--update-s", "inf"], "--update-s", "inf"),
    (["--host-gbps", "-1"], "--host-gbps", "-1.0"),
    (["--share-slowdown", "1.5"], "--share-slowdown", "1.5"),
    (["--share-slowdown-tail", "-0.1"], "--share-slowdown-tail", "-0.1"),
    (["--trajectories", "0"], "--trajectories", "0"),
    (["--dedicated", "a,b"], "--dedicated", "'a,b'"),
])
def test_bad_inputs_name_the_flag_the_value_and_the_fix(argv, flag, value):
    status, text = main(argv)
    assert status == 2
    assert f"{flag} {value}:" in text and "Fix:" in text


def test_bad_inputs_raise_value_error_when_built_in_code():
    with pytest.raises(ValueError, match=r"--dedicated 8: .*N = --nodes 1 x --gpus-per-node 8 = 8.*Fix:"):
        dataclasses.replace(PRESET, dedicated=(8,))
    with pytest.raises(ValueError, match=r"--rm-tok-s -1\.0: must be a number > 0\. Fix:"):
        dataclasses.replace(PRESET, rm_tok_s=-1.0)
    with pytest.raises(ValueError, match=r"--saturation-batch True: .*Fix:"):
        dataclasses.replace(PRESET, saturation_batch=True)


def test_the_preset_table_in_the_docs_is_the_models_output():
    _, text = main([])
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    docs = (REPO_ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    missing = [row for row in rows if row not in docs]
    assert rows and missing == [], "docs/benchmarks.md is stale: paste `verl-async-rm bench layout`'s table"


def test_the_cli_runs_bench_layout(tmp_path, capsys):
    from verl_async_rm.cli import main as cli_main

    assert cli_main(["bench", "layout", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench_layout.json").is_file() and "overlapped" in capsys.readouterr().out
