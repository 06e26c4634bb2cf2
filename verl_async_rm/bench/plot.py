"""The overlap benchmark's PNG: step time (rollout + reward tail) per policy against the bound, and the tails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_report"]


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Draw ``report`` (the JSON object of :mod:`verl_async_rm.bench.report`) into ``path`` with matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    policies = report["policies"]
    names = list(policies)
    step = [policies[n]["step_s"] for n in names]
    tail = [policies[n]["reward_tail_s"] for n in names]
    rollout = [s - t for s, t in zip(step, tail)]
    lone = report["lone_latency_s"]

    fig = Figure(figsize=(11, 4.2), dpi=110)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.bar(names, rollout, color="#9bb7d4", label="rollout (last finish)")
    ax1.bar(names, tail, bottom=rollout, color="#d9534f", label="reward tail")
    ax1.axhline(report["bound_s"], color="black", linestyle="--", linewidth=1, label=f"bound {report['bound_s']:.2f} s")
    for x, s in enumerate(step):
        ax1.text(x, s, f"{s:.2f}", ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("step time (workload s)")
    ax1.set_title(f"step time; async/bound = {report['async_over_bound']:.3f}, "
                  f"speedup vs sync {report['speedup_vs_sync']:.3f}")
    ax1.legend(fontsize=8, loc="lower right")

    ax2.bar(names, [t * 1e3 for t in tail], color="#d9534f")
    ax2.axhline(lone * 1e3, color="black", linestyle="--", linewidth=1, label=f"lone latency {lone * 1e3:.0f} ms")
    ax2.axhline(1.1 * lone * 1e3, color="grey", linestyle=":", linewidth=1, label="1.10 x lone")
    ax2.set_yscale("log")
    ax2.set_ylabel("reward tail (workload ms, log)")
    ax2.set_title("last score - last finish")
    ax2.legend(fontsize=8)
    params = report["params"]
    fig.suptitle(f"overlap benchmark: B={params['trajectories']}, R={params['replicas']}, rm={params['rm']}, "
                 f"clock={report['clock']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
