"""The demo's figure (``reward_curve.png``): the mean RM score per training step of each mode (the policy learning to
raise it), and each mode's mean step time split into phases (:data:`verl_async_rm.demo.summary.PHASES`), next to the
run with no RM. Matplotlib's Agg backend: no display needed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["plot_training"]

_COLORS = {"rollout": "#4c72b0", "reward_tail": "#dd8452", "log_prob": "#55a868", "update": "#c44e52",
           "weight_sync": "#8172b3", "other": "#bbbbbb"}


def plot_training(summary: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Draw ``summary`` (``summary.json``'s content) to ``path`` (PNG) and return the path as a string."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_async_rm.demo.summary import PHASES

    modes = summary["modes"]
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})
    for m in modes.values():
        points = [(s["step"], s["mean_rm_score"]) for s in m["per_step"] if s["mean_rm_score"] is not None]
        if points:
            curve.plot(*zip(*points), marker="o", label=m["label"])
    curve.set_xlabel("training step")
    curve.set_ylabel("mean RM score of the step's trajectories")
    curve.set_title("the policy raises the RM score (GRPO, verl's own trainer)")
    curve.grid(alpha=0.3)
    curve.legend(fontsize=8)

    labels = [m["label"] for m in modes.values()]
    left = [0.0] * len(labels)
    for phase in PHASES:
        widths = [m[f"{phase}_s"] for m in modes.values()]
        bars.barh(labels, widths, left=left, color=_COLORS[phase], label=phase.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    steady = next(iter(modes.values()))["steady_steps"]
    bars.set_xlabel(f"mean seconds per step (steps {steady[0]}-{steady[-1]})")
    bars.set_title("where a step's time goes")
    bars.invert_yaxis()
    bars.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False,
                handlelength=1.0, columnspacing=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
