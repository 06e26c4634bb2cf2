"""The demo's PNG timeline: per mode, one row per RM replica with its batches (verl's served RM: its requests, one
row per request in flight at once), and the rollout completion curve.

Each mode's steps are laid end to end on one time axis (seconds since that mode's first step began, each step's own
idle gaps removed), so the two panels share the x axis and the longer synchronous steps show as a longer panel.
Matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from verl_async_rm.demo.timeline import StepTimeline

__all__ = ["plot_timeline"]

_MODE_TITLES = {
    "async": "async RM: each trajectory scored as its agent loop ends",
    "async_vllm": "async RM on vLLM (engine=vllm): each trajectory scored as its agent loop ends",
    "sync": "sync: whole batch scored after the rollout",
    "verl_served": "verl's served RM (vLLM): one request per trajectory as its agent loop ends",
}
_ORDER = ("async", "async_vllm", "sync", "verl_served")


def plot_timeline(modes: Mapping[str, Sequence[StepTimeline]], path: str | os.PathLike) -> str:
    """Draw ``{mode: steps}`` to ``path`` (PNG) and return the path as a string."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = [m for m in _ORDER if m in modes] + [m for m in modes if m not in _ORDER]
    if not names:
        raise ValueError("plot_timeline needs at least one mode with steps")
    lanes = {id(s): _lanes(s.rm_calls) for m in names for s in modes[m]}
    served = {m: any(s.rm_calls for s in modes[m]) for m in names}
    rows = {m: max([max(lanes[id(s)], default=-1) + 1 if served[m] else s.num_replicas for s in modes[m]] + [1])
            for m in names}
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.6 + sum(1.1 * (rows[m] + 1) for m in names)), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [rows[m] + 1 for m in names]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes[:, 0], names, strict=True):
        offset = 0.0
        curve = ax.twinx()
        total = 0.0
        for step in modes[name]:
            for b in step.batches:
                ax.broken_barh([(offset + b.start - step.t0, max(b.duration, 1e-3))], (b.replica - 0.35, 0.7),
                               facecolors=colors[b.replica % len(colors)], edgecolors="black", linewidth=0.4)
                if b.duration > 0.04 * max(step.step_time_s, 1e-9):
                    ax.text(offset + (b.start + b.end) / 2 - step.t0, b.replica, str(b.size), ha="center",
                            va="center", fontsize=7)
            for (start, end), lane in zip(sorted(step.rm_calls), lanes[id(step)], strict=True):
                ax.broken_barh([(offset + start - step.t0, max(end - start, 1e-3))], (lane - 0.35, 0.7),
                               facecolors=colors[lane % len(colors)], edgecolors="black", linewidth=0.3)
            finishes = sorted(t - step.t0 for t in step.finishes)
            if finishes:
                xs = [offset] + [offset + t for t in finishes]
                ys = [0.0] + [(k + 1) / len(finishes) for k in range(len(finishes))]
                curve.step(xs, ys, where="post", color="tab:gray", linewidth=1.2)
            ax.axvline(offset + step.step_time_s, color="black", linestyle="--", linewidth=0.8)
            offset += step.step_time_s
            total += step.step_time_s
        ax.set_yticks(range(rows[name]), [f"requests in flight {r + 1}" if served[name] else f"RM replica {r}"
                                          for r in range(rows[name])])
        ax.set_ylim(-0.6, rows[name] - 0.4)
        curve.set_ylim(0, 1.05)
        curve.set_ylabel("rollout done", color="tab:gray")
        n = len(modes[name])
        bars = "RM requests" if served[name] else "RM batches, label = size"
        ax.set_title(f"{_MODE_TITLES.get(name, name)} - {n} step(s), {total:.1f} s\n"
                     f"(bars: {bars}; gray: fraction of trajectories finished; dashes: step end)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds (steps laid end to end)")
    fig.tight_layout()
    out = os.fspath(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


_MAX_LANES = 8


def _lanes(calls) -> list[int]:
    """A row for each ``(start, end)`` call (in sorted order): the lowest row free at its start (at most 8 rows: later
    ones share the last)."""
    ends: list[float] = []
    out = []
    for start, end in sorted(calls):
        lane = next((k for k, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        out.append(min(lane, _MAX_LANES - 1))
    return out
