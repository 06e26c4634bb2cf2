"""``verl-async-rm bench``: the overlap benchmark's command line, JSON report and printed table.

Draws the workload (:mod:`~verl_async_rm.bench.workload`), computes the bound and the ``sync`` prediction
(:mod:`~verl_async_rm.bench.bound`), runs the policies (:mod:`~verl_async_rm.bench.overlap`), writes
``overlap.json`` and ``overlap.png`` (:mod:`~verl_async_rm.bench.plot`) into ``--out`` (default: a fresh
``bench-overlap-<time>`` folder) and returns a table. Every time in the report is in workload seconds (``*_ms``:
workload milliseconds), whatever the clock.

Top-level JSON keys: ``benchmark``, ``clock``, ``time_scale``, ``params``, ``rm_model``, ``workload``, ``bound``
(every computed figure), ``bound_s``, ``lone_latency_s``, ``predicted_speedup``, ``async_over_bound``,
``speedup_vs_sync``, ``async_tail_over_lone``, ``targets``, ``policies`` (``sync``, ``per-request``, ``eager``,
``async``, ``bound``; each with ``step_s``, ``reward_tail_s``, ``rm_utilization``, ``mean_batch_size``,
``padding_fraction``, ``p50_wait_ms``, ``p99_wait_ms``, ``siblings_met``), ``batcher_policies``, ``environment``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from verl_async_rm.bench.bound import compute_bound
from verl_async_rm.bench.environment import environment_snapshot
from verl_async_rm.bench.overlap import POLICIES, batcher_policies, run_policies
from verl_async_rm.bench.workload import RMCostModel, WorkloadConfig, generate_workload

__all__ = ["METRICS", "build_parser", "main", "run"]

#: The keys of every policy object under ``policies``.
METRICS = ("step_s", "reward_tail_s", "rm_utilization", "mean_batch_size", "padding_fraction", "p50_wait_ms",
           "p99_wait_ms", "siblings_met")

#: Real seconds per workload second on the real clock: the defaults (a ~62 s rollout, four policies) run in ~1 min.
DEFAULT_TIME_SCALE = 0.2

#: Targets (see the README): async within 5% of the bound, tail within 10% of one lone request, speedup within 5%.
TARGET_OVER_BOUND = 1.05
TARGET_TAIL_OVER_LONE = 1.10
TARGET_SPEEDUP_REL = 0.05


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-async-rm bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="`verl-async-rm bench batcher --help`: the batcher micro-benchmark.")
    parser.add_argument("--trajectories", type=int, default=1024, help="trajectories in the step, B (default 1024)")
    parser.add_argument("--replicas", type=int, default=4, help="RM replicas, R (default 4)")
    parser.add_argument("--rm", choices=["sim", "tiny"], default="sim",
                        help="sim: a ~7B RM on one H100 (a=30 ms, b=40 us/token); tiny: a and b fitted to the real "
                        "tiny RM on this CPU (default sim)")
    parser.add_argument("--rm-batch-ms", type=float, default=None,
                        help="with --rm sim: your RM's fixed cost per batch call, a, in ms (measure a batch of one "
                        "short input; default 30)")
    parser.add_argument("--rm-us-per-token", type=float, default=None,
                        help="with --rm sim: your RM's cost per padded token, b, in microseconds (measure a large "
                        "batch; default 40)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="batch cap of sync, eager and async (default: BatchPolicy's, 32)")
    parser.add_argument("--max-wait-ms", type=float, default=None,
                        help="async's max_wait_ms in workload ms (default: BatchPolicy's, 20)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--rollout-n", type=int, default=1,
                        help="responses per prompt (GRPO's rollout.n); > 1 reports siblings_met (default 1)")
    parser.add_argument("--prefer-siblings", action="store_true",
                        help="async: BatchPolicy(prefer_siblings=True), siblings first in a batch")
    parser.add_argument("--clock", choices=["real", "virtual"], default="real",
                        help="real: asyncio on the wall clock, scaled by --time-scale; virtual: deterministic "
                        "simulated time (default real)")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                        help=f"real seconds per workload second on the real clock (default {DEFAULT_TIME_SCALE})")
    parser.add_argument("--out", default=None, help="output folder (default: ./bench-overlap-<time>)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if a target is missed")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.trajectories < 1:
        parser.error(f"--trajectories must be >= 1, got {args.trajectories}")
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.rollout_n < 1:
        parser.error(f"--rollout-n must be >= 1, got {args.rollout_n}")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.max_wait_ms is not None and not args.max_wait_ms >= 0:
        parser.error(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}")
    for flag, value in (("--rm-batch-ms", args.rm_batch_ms), ("--rm-us-per-token", args.rm_us_per_token)):
        if value is not None and (args.rm != "sim" or not value >= 0):
            parser.error(f"{flag}={value}: needs --rm sim and a value >= 0 (measured on your RM)")
    if not 0 < args.time_scale <= 100:
        parser.error(f"--time-scale must be in (0, 100], got {args.time_scale}")


def run(args: argparse.Namespace, *, progress=None) -> dict[str, Any]:
    """Run the benchmark described by parsed ``args``; the report as a JSON-serialisable dict."""
    calibration = None
    if args.rm == "tiny":
        from verl_async_rm.bench.calibrate import calibrate_tiny_rm

        cost, calibration = calibrate_tiny_rm(seed=args.seed)
    else:
        default = RMCostModel()
        cost = RMCostModel(
            a_s=default.a_s if args.rm_batch_ms is None else args.rm_batch_ms / 1e3,
            b_s_per_token=default.b_s_per_token if args.rm_us_per_token is None else args.rm_us_per_token / 1e6,
            **({"source": "given on the command line"} if args.rm_batch_ms is not None
               or args.rm_us_per_token is not None else {}),
        )
    workload_config = WorkloadConfig(trajectories=args.trajectories, seed=args.seed, rollout_n=args.rollout_n)
    workload = generate_workload(workload_config)
    policies = batcher_policies(args.max_batch_size, args.max_wait_ms, args.prefer_siblings)
    cap = policies["async"].max_batch_size
    bound = compute_bound(workload, cost, args.replicas, cap)
    scale = args.time_scale if args.clock == "real" else 1.0
    results = run_policies(workload, cost, replicas=args.replicas, policies=policies, clock=args.clock, scale=scale,
                           predicted_sync_step_s=bound.predicted_sync_step_s, on_done=progress)
    results["bound"] = {
        "step_s": bound.bound_s, "reward_tail_s": bound.bound_s - bound.rollout_s,
        **{k: None for k in METRICS if k not in ("step_s", "reward_tail_s")},
    }
    a, s = results["async"], results["sync"]
    over_bound = a["step_s"] / bound.bound_s
    speedup = s["step_s"] / a["step_s"]
    tail_over_lone = a["reward_tail_s"] / bound.lone_latency_s
    return {
        "benchmark": "overlap",
        "clock": args.clock,
        "time_scale": scale,
        "units": "workload seconds (ms for *_ms); time_scale real seconds per workload second",
        "params": {"trajectories": args.trajectories, "replicas": args.replicas, "rm": args.rm,
                   "max_batch_size": cap, "max_wait_ms": policies["async"].max_wait_ms, "seed": args.seed,
                   "rollout_n": args.rollout_n},
        "rm_model": {"a_s": cost.a_s, "b_s_per_token": cost.b_s_per_token, "source": cost.source,
                     "calibration": calibration},
        "workload": {"config": _plain(workload_config), **workload.summary()},
        "bound": bound.to_dict(),
        "bound_s": bound.bound_s,
        "lone_latency_s": bound.lone_latency_s,
        "predicted_speedup": bound.predicted_speedup,
        "async_over_bound": over_bound,
        "speedup_vs_sync": speedup,
        "async_tail_over_lone": tail_over_lone,
        "targets": {
            "async_over_bound<=1.05": over_bound <= TARGET_OVER_BOUND,
            "async_tail<=1.10xlone": tail_over_lone <= TARGET_TAIL_OVER_LONE,
            "speedup_within_5pct_of_predicted": abs(speedup / bound.predicted_speedup - 1) <= TARGET_SPEEDUP_REL,
        },
        "policies": {name: results[name] for name in (*POLICIES, "bound")},
        "batcher_policies": {name: dataclasses.asdict(p) for name, p in policies.items()},
        "environment": environment_snapshot(),
    }


def _plain(config: WorkloadConfig) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(config)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict[str, Any]) -> str:
    """The policies side by side, then the three targets."""
    header = ("policy", "step_s", "tail_s", "rm_util", "batch", "padding", "p50_wait_ms", "p99_wait_ms")
    rows = [header]
    for name, m in report["policies"].items():
        rows.append((name, _fmt(m["step_s"], ".3f"), _fmt(m["reward_tail_s"], ".3f"), _fmt(m["rm_utilization"], ".3f"),
                     _fmt(m["mean_batch_size"], ".2f"), _fmt(m["padding_fraction"], ".3f"),
                     _fmt(m["p50_wait_ms"], ".1f"), _fmt(m["p99_wait_ms"], ".1f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    t = report["targets"]
    a = report["policies"]["async"]

    def ok(key: str) -> str:
        return "ok" if t[key] else "MISSED"

    lines += [
        "",
        (f"async / bound            {report['async_over_bound']:.4f}   (target <= {TARGET_OVER_BOUND})  "
         f"{ok('async_over_bound<=1.05')}"),
        (f"async tail / lone        {report['async_tail_over_lone']:.4f}   (lone "
         f"{report['lone_latency_s'] * 1e3:.1f} ms; target <= {TARGET_TAIL_OVER_LONE})  {ok('async_tail<=1.10xlone')}"),
        (f"speedup vs sync          {report['speedup_vs_sync']:.4f}   (predicted {report['predicted_speedup']:.4f}; "
         f"target within 5%)  {ok('speedup_within_5pct_of_predicted')}"),
        (f"async's last trajectory: waited {a['last_item_wait_ms']:.1f} ms for a batch of "
         f"{a['last_item_batch_size']} (model {a['last_item_batch_model_ms']:.1f} ms), answered "
         f"{a['last_item_late_ms']:.1f} ms after the model"),
        (f"clock {report['clock']} (x{report['time_scale']:g} real s per workload s); RM model: "
         f"{report['rm_model']['source']}"),
    ]
    if report["params"].get("rollout_n", 1) > 1:
        met = ", ".join(f"{name} {_fmt(m['siblings_met'], '.3f')}" for name, m in report["policies"].items()
                        if m["siblings_met"] is not None)
        rollout_n = report["params"]["rollout_n"]
        lines.append(f"trajectories scored in a batch with a sibling (rollout.n {rollout_n}): {met}")
    return "\n".join(lines)


def main(argv: list[str]) -> tuple[int, str]:
    """Entry point of ``verl-async-rm bench``: runs it, writes the files; returns (exit status, report text)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    out_dir = Path(args.out) if args.out else Path.cwd() / time.strftime("bench-overlap-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = run(args)
    json_path = out_dir / "overlap.json"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False))
    from verl_async_rm.bench.plot import plot_report

    png_path = plot_report(report, out_dir / "overlap.png")
    text = f"{table(report)}\n\nwrote {json_path}\n      {png_path}\noutput folder: {out_dir}"
    return (1 if args.strict and not all(report["targets"].values()) else 0), text
