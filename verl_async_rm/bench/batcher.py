"""``verl-async-rm bench batcher``: measure the batcher on this machine (a benchmark, not a test).

Measures, in one process with the stock asyncio loop:

* per-request overhead with a no-op batch function: closed loop (callers that each submit again as soon as they get
  an answer: the full submit -> batch -> result path) and burst (one new task per request, as many trajectories
  finishing at once; also reported net of the cost of the same burst of trivial tasks);
* throughput and mean batch fill at saturation (open-loop arrivals faster than the replicas can serve);
* lone-request latency at low load (bound: max_wait + execution + 5 ms);
* tail after flush (from ``flush()`` to the last caller holding its result; bound: 5 ms);
* deadline expiry while every replica is busy (bound: deadline + 10 ms), and that cancelled requests never execute.

Prints a table and writes ``batcher.json`` under ``--out`` (default: a fresh ``bench-batcher-<time>`` folder).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from verl_async_rm.errors import RequestTimeoutError
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy

__all__ = ["main"]


async def _noop(items: list[Any], replica: Any, deadline: float) -> list[Any]:
    return items


def _sleeper(exec_s: float):
    async def batch_fn(items: list[Any], replica: Any, deadline: float) -> list[Any]:
        await asyncio.sleep(exec_s)
        return items

    return batch_fn


async def _trivial(i: int) -> int:
    return i


async def bench_overhead(requests: int, cap: int, reps: int) -> dict[str, Any]:
    """No-op batch function, one replica: microseconds per request, closed loop and burst."""
    closed, burst, base, fills = [], [], [], []
    callers = 4 * cap
    per_caller = max(1, requests // callers)
    for _ in range(reps):
        batcher = Batcher(_noop, BatchPolicy(max_batch_size=cap, max_wait_ms=1.0), replicas=1)
        await asyncio.gather(*(batcher.submit(i) for i in range(2 * cap)))  # warm up

        async def caller(c: int) -> None:
            for i in range(per_caller):
                await batcher.submit(i)

        gc.collect()
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(c) for c in range(callers)))
        closed.append((time.perf_counter() - t0) / (callers * per_caller))
        gc.collect()
        t0 = time.perf_counter()
        await asyncio.gather(*(batcher.submit(i) for i in range(requests)))
        burst.append((time.perf_counter() - t0) / requests)
        fills.append(batcher.stats()["mean_fill"])
        await batcher.aclose()
        gc.collect()
        t0 = time.perf_counter()
        await asyncio.gather(*(_trivial(i) for i in range(requests)))
        base.append((time.perf_counter() - t0) / requests)
    closed_us = statistics.median(closed) * 1e6
    burst_us = statistics.median(burst) * 1e6
    base_us = statistics.median(base) * 1e6
    return {
        "closed_loop_us": closed_us,
        "closed_loop_req_per_s": 1e6 / closed_us,
        "burst_us": burst_us,
        "burst_req_per_s": 1e6 / burst_us,
        "burst_trivial_task_us": base_us,
        "burst_net_us": burst_us - base_us,
        "mean_fill": statistics.mean(fills),
        "callers": callers,
        "requests": requests,
        "reps": reps,
    }


async def bench_saturation(cap: int, replicas: int, exec_s: float, max_wait_ms: float, duration_s: float,
                           overload: float) -> dict[str, Any]:
    """Open-loop arrivals at ``overload`` x what the replicas can serve; batch fill and throughput."""
    capacity = replicas * cap / exec_s
    rate = overload * capacity
    batcher = Batcher(_sleeper(exec_s), BatchPolicy(max_batch_size=cap, max_wait_ms=max_wait_ms),
                                      replicas=replicas)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Future] = []
    t0 = loop.time()
    sent = 0
    while (now := loop.time()) - t0 < duration_s:
        due = int((now - t0) * rate)
        tasks.extend(asyncio.ensure_future(batcher.submit(i)) for i in range(sent, due))
        sent = due
        await asyncio.sleep(0.001)
    batcher.flush()
    await asyncio.gather(*tasks)
    elapsed = loop.time() - t0
    stats = batcher.stats()
    await batcher.aclose()
    return {
        "requests": sent,
        "arrival_rate_per_s": rate,
        "capacity_per_s": capacity,
        "throughput_per_s": sent / elapsed,
        "batches": stats["batches"],
        "mean_batch_size": stats["batch_size"]["mean"],
        "mean_fill": stats["mean_fill"],
        "flush_reasons": stats["flush_reasons"],
        "wait_ms_p50": stats["wait_ms"]["p50"],
        "cap": cap, "replicas": replicas, "exec_ms": exec_s * 1e3, "max_wait_ms": max_wait_ms,
    }


async def bench_lone(exec_s: float, max_wait_ms: float, reps: int, gap_s: float) -> dict[str, Any]:
    """One request at a time, far apart: latency against max_wait + execution.

    Execution is timed inside the batch function (what the RM really took, timer lateness of this machine included),
    so ``latency - execution - max_wait`` is the batcher's excess: how late its max_wait timer fired plus its own
    overhead. As a control, the lateness of a bare ``asyncio.sleep(max_wait)`` on this machine is measured too.
    """
    spans: list[tuple[float, float]] = []

    async def timed(items: list[Any], replica: Any, deadline: float) -> list[Any]:
        t0 = time.perf_counter()
        await asyncio.sleep(exec_s)
        spans.append((t0, time.perf_counter()))
        return items

    max_wait_s = max_wait_ms / 1e3
    batcher = Batcher(timed, BatchPolicy(max_batch_size=64, max_wait_ms=max_wait_ms))
    latencies, excess, control = [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        await batcher.submit(i)
        t1 = time.perf_counter()
        start, end = spans[-1]
        latencies.append(t1 - t0)
        excess.append((t1 - t0) - (end - start) - max_wait_s)
        await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        await asyncio.sleep(max_wait_s)
        control.append(time.perf_counter() - t0 - max_wait_s)
        await asyncio.sleep(gap_s)
    await batcher.aclose()
    return {
        "latency_p50_ms": statistics.median(latencies) * 1e3,
        "latency_max_ms": max(latencies) * 1e3,
        "execution_p50_ms": statistics.median(e - s for s, e in spans) * 1e3,
        "excess_p50_ms": statistics.median(excess) * 1e3,
        "excess_p90_ms": _quantile(excess, 0.9) * 1e3,
        "excess_max_ms": max(excess) * 1e3,
        "control_sleep_late_p50_ms": statistics.median(control) * 1e3,
        "control_sleep_late_p90_ms": _quantile(control, 0.9) * 1e3,
        "control_sleep_late_max_ms": max(control) * 1e3,
        "max_wait_ms": max_wait_ms, "exec_ms_requested": exec_s * 1e3, "reps": reps,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_flush_tail(cap: int, replicas: int, reps: int) -> dict[str, Any]:
    """Requests that would never flush by themselves; time from flush() to the last caller resuming.

    The checked sizes stay below the cap (more would flush by size before the flush); ``backlog`` flushes several
    batches' worth per replica at once, which measures mostly how fast the callers can be resumed one after another.
    """
    gate = asyncio.Event()

    async def holdable(items: list[Any], replica: Any, deadline: float) -> list[Any]:
        if items[0] == "hold":
            await gate.wait()
        return items

    batcher = Batcher(holdable, BatchPolicy(max_batch_size=cap, max_wait_ms=3_600_000.0),
                                      replicas=replicas)
    sizes = sorted({1, max(1, cap // 4), max(1, cap // 2), cap - 1})
    backlog = 3 * replicas * cap + 5
    tails: dict[int, list[float]] = {k: [] for k in [*sizes, backlog]}
    for _ in range(reps):
        for k in tails:
            if k == backlog:  # hold every replica so that the backlog cannot flush by size before the flush
                gate.clear()
                tasks = [asyncio.ensure_future(batcher.submit("hold")) for _ in range(replicas)]
                await asyncio.sleep(0)
                batcher.flush()
            else:
                tasks = []
            tasks += [asyncio.ensure_future(batcher.submit(i)) for i in range(k)]
            for _ in range(3):
                await asyncio.sleep(0)  # let every caller enqueue
            t0 = time.perf_counter()
            gate.set()
            batcher.flush()
            await asyncio.gather(*tasks)
            tails[k].append(time.perf_counter() - t0)
    await batcher.aclose()
    checked = [t for k in sizes for t in tails[k]]
    return {
        "p50_ms": statistics.median(checked) * 1e3,
        "max_ms": max(checked) * 1e3,
        "by_pending": {k: {"p50_ms": statistics.median(ts) * 1e3, "max_ms": max(ts) * 1e3} for k, ts in tails.items()},
        "backlog": backlog, "reps": reps, "cap": cap, "replicas": replicas,
    }


async def bench_deadline_and_cancel(deadline_s: float, reps: int) -> dict[str, Any]:
    """Deadline expiry while the only replica is busy; cancelled and expired requests never executed."""
    gate = asyncio.Event()
    seen: set[Any] = set()

    async def gated(items: list[Any], replica: Any, deadline: float) -> list[Any]:
        seen.update(items)
        await gate.wait()
        return items

    batcher = Batcher(gated, BatchPolicy(max_batch_size=8, max_wait_ms=0))
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await asyncio.sleep(0.01)
    late = []
    for i in range(reps):
        t0 = time.perf_counter()
        try:
            await batcher.submit(("late", i), deadline_s=deadline_s)
        except RequestTimeoutError:
            late.append(time.perf_counter() - t0 - deadline_s)
    tasks = [asyncio.ensure_future(batcher.submit(("c", i))) for i in range(1000)]
    await asyncio.sleep(0)
    for task in tasks[::2]:
        task.cancel()
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*tasks, busy, return_exceptions=True)
    cancelled_executed = sum(1 for i in range(0, 1000, 2) if ("c", i) in seen)
    expired_executed = sum(1 for i in range(reps) if ("late", i) in seen)
    await batcher.aclose()
    return {"late_p50_ms": statistics.median(late) * 1e3, "late_max_ms": max(late) * 1e3,
            "timed_out": len(late), "reps": reps, "deadline_ms": deadline_s * 1e3,
            "cancelled_executed": cancelled_executed, "expired_executed": expired_executed}


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("measure", "measured", "target", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    results: dict[str, Any] = {}
    results["overhead"] = await bench_overhead(args.requests // (5 if quick else 1), args.max_batch_size,
                                               reps=1 if quick else 5)
    results["saturation"] = await bench_saturation(args.max_batch_size, args.replicas, args.exec_ms / 1e3,
                                                   args.max_wait_ms, duration_s=0.5 if quick else 2.0, overload=1.5)
    results["lone"] = await bench_lone(args.exec_ms / 1e3, args.max_wait_ms, reps=10 if quick else 40, gap_s=0.02)
    results["flush_tail"] = await bench_flush_tail(args.max_batch_size, args.replicas, reps=3 if quick else 20)
    results["deadline"] = await bench_deadline_and_cancel(0.05, reps=5 if quick else 20)
    return results


def _rows(r: dict[str, Any], args: argparse.Namespace) -> tuple[list[tuple[str, str, str, str]], dict[str, bool]]:
    o, s, lone, tail, d = r["overhead"], r["saturation"], r["lone"], r["flush_tail"], r["deadline"]
    checks = {
        "overhead_closed_loop": o["closed_loop_us"] <= 30.0,
        "overhead_burst_net": o["burst_net_us"] <= 30.0,
        "fill_at_saturation": s["mean_fill"] >= 0.9,
        "lone_latency": lone["excess_max_ms"] <= 5.0,
        "tail_after_flush": tail["max_ms"] <= 5.0,
        "deadline_while_busy": d["late_max_ms"] <= 10.0,
        "cancelled_executed": d["cancelled_executed"] == 0 and d["expired_executed"] == 0,
    }

    def row(label: str, measured: str, target: str = "", key: str | None = None) -> tuple[str, str, str, str]:
        return label, measured, target, "" if key is None else ("ok" if checks[key] else "MISSED")

    rows = [
        row("overhead, closed loop (no-op batch)", f"{o['closed_loop_us']:.1f} us/req", "<= 30 us",
            "overhead_closed_loop"),
        row("  throughput, closed loop", f"{o['closed_loop_req_per_s']:,.0f} req/s", ">= 30k req/s",
            "overhead_closed_loop"),
        row("overhead, burst (task per request)", f"{o['burst_us']:.1f} us/req"),
        row("  of which creating the tasks", f"{o['burst_trivial_task_us']:.1f} us/req"),
        row("  net of task creation", f"{o['burst_net_us']:.1f} us/req", "<= 30 us", "overhead_burst_net"),
        row(f"fill at saturation (cap {s['cap']}, {s['replicas']} replicas)", f"{s['mean_fill']:.3f} x cap",
            ">= 0.9 x cap", "fill_at_saturation"),
        row("  throughput at saturation", f"{s['throughput_per_s']:,.0f} req/s",
            f"(capacity {s['capacity_per_s']:,.0f})"),
        row("lone request: latency - execution - max_wait, max", f"{lone['excess_max_ms']:.2f} ms", "<= 5 ms",
            "lone_latency"),
        row("  p50 / p90", f"{lone['excess_p50_ms']:.2f} / {lone['excess_p90_ms']:.2f} ms"),
        row("  control: bare asyncio.sleep lateness p50 / p90 / max",
            f"{lone['control_sleep_late_p50_ms']:.2f} / {lone['control_sleep_late_p90_ms']:.2f} / "
            f"{lone['control_sleep_late_max_ms']:.2f} ms", "(this machine)"),
        row("  latency p50 / max", f"{lone['latency_p50_ms']:.1f} / {lone['latency_max_ms']:.1f} ms",
            f"(execution p50 {lone['execution_p50_ms']:.1f} ms)"),
        row(f"tail after flush, max (1..{s['cap'] - 1} pending)", f"{tail['max_ms']:.2f} ms", "<= 5 ms",
            "tail_after_flush"),
        row("  p50", f"{tail['p50_ms']:.2f} ms"),
        row(f"  backlog of {tail['backlog']} over {tail['replicas']} replicas, p50",
            f"{tail['by_pending'][tail['backlog']]['p50_ms']:.2f} ms", "(info)"),
        row("deadline expiry while busy, late by (max)", f"{d['late_max_ms']:.2f} ms", "<= 10 ms",
            "deadline_while_busy"),
        row("  p50", f"{d['late_p50_ms']:.2f} ms"),
        row("cancelled / expired requests executed", f"{d['cancelled_executed']} / {d['expired_executed']}", "0",
            "cancelled_executed"),
    ]
    return rows, checks


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def main(argv: list[str]) -> tuple[int, str]:
    """Entry point of ``verl-async-rm bench batcher``: runs it, writes the JSON; returns (exit status, report text)."""
    parser = argparse.ArgumentParser(prog="verl-async-rm bench batcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for batcher.json (default: ./bench-batcher-<time>)")
    parser.add_argument("--requests", type=int, default=20_000, help="requests per overhead run (default 20000)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="batch cap (default 64)")
    parser.add_argument("--replicas", type=int, default=2, help="replicas for saturation and flush runs (default 2)")
    parser.add_argument("--exec-ms", type=float, default=20.0, help="batch execution time in ms (default 20)")
    parser.add_argument("--max-wait-ms", type=float, default=10.0, help="max_wait_ms (default 10)")
    parser.add_argument("--quick", action="store_true", help="fewer requests and repetitions (a smoke run)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if a target is missed")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_batch_size < 2 or args.replicas < 1 or args.exec_ms <= 0 or args.max_wait_ms < 0:
        parser.error("need --requests >= 1, --max-batch-size >= 2, --replicas >= 1, --exec-ms > 0, --max-wait-ms >= 0")
    out_dir = Path(args.out) if args.out else Path.cwd() / time.strftime("bench-batcher-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)

    load_before = _load()
    results = asyncio.run(_run(args))
    load_after = _load()
    rows, checks = _rows(results, args)
    report = {
        "benchmark": "batcher",
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_1min_before": load_before, "load_avg_1min_after": load_after},
        "params": vars(args) | {"out": str(out_dir)},
        "results": results,
        "targets_met": checks,
    }
    path = out_dir / "batcher.json"
    path.write_text(json.dumps(report, indent=2))
    text = (
        f"{_table(rows)}\n\n{os.cpu_count()} CPUs; 1-minute load average {load_before} before the run, "
        f"{load_after} after\n\nwrote {path}"
    )
    return (1 if args.strict and not all(checks.values()) else 0), text
