"""The demo's figures, from what verl logged (pure functions): per step and mode, the step time split into phases and
the mean RM score; per mode, the means over the steady steps and the RM's overhead against the run with no RM; the
printed report.

Phases of a step (seconds; verl's ``timing_s/*`` and the demo sampler's ``demo/*``):

- ``rollout``: from the start of verl's ``gen`` phase to the last trajectory's generation end;
- ``reward_tail``: from then until verl's replay buffer returned the batch, every reward known;
- ``log_prob``: verl's ``old_log_prob`` + ``ref`` (the actor's and the reference's log-probs);
- ``update``: verl's ``adv`` + ``update_actor``;
- ``weight_sync``: verl's ``update_weights`` (the actor's weights into the vLLM rollout);
- ``other``: the rest of verl's ``step`` (dispatch, rollout sleep, batch balance; the RM's sleep and wake on the
  policy's GPU).

The first step also starts vLLM's engine (its first generation is slow): the means and the overhead are taken over the
steps after it (``STEADY_FROM``).
"""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Mapping
from statistics import mean
from typing import Any

from verl_async_rm.demo.modes import LABELS

__all__ = ["PHASES", "STEADY_FROM", "SUMMARY_KEYS", "build_summary", "environment", "format_report", "step_record"]

#: Phase name -> how it is computed from one row of verl's step metrics.
PHASES = ("rollout", "reward_tail", "log_prob", "update", "weight_sync", "other")
#: Steps from this one on are averaged (the first starts vLLM's engine).
STEADY_FROM = 2
#: Top-level keys of ``summary.json``, in order.
SUMMARY_KEYS = ("config", "environment", "wall_s", "setup_s", "modes", "overhead_vs_no_rm", "files")


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every run."""
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "verl_async_rm": version("verl-async-rm"), "verl": version("verl"), "ray": version("ray"),
        "torch": version("torch"), "vllm": version("vllm"), "transformers": version("transformers"),
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "load_average": load, "argv": list(sys.argv),
    }


def _rm_score(trajectory: Mapping[str, Any], mode: str) -> float | None:
    """A trajectory's RM score: the plugin's ``rm_score`` (also what the verl_served mode's reward function reports);
    None without an RM."""
    if mode == "no_rm":
        return None
    info = trajectory.get("reward_extra_info") or {}
    return float(info["rm_score"]) if "rm_score" in info else None


def step_record(metrics: Mapping[str, Any], trajectories: list[Mapping[str, Any]], mode: str) -> dict[str, Any]:
    """One step of one mode: its phases (module doc), its mean RM score and reward, its trajectories."""
    # the v0 trainer logs what its manager reports as timing_s/...: read both trainers' names alike
    d = {**metrics, **{k.removeprefix("timing_s/"): v for k, v in metrics.items()
                       if k.startswith(("timing_s/demo/", "timing_s/async_rm/"))}}
    phases = {
        "rollout": float(d["demo/rollout_s"]),
        "reward_tail": float(d["demo/reward_tail_s"]),
        "log_prob": float(d["timing_s/old_log_prob"]) + float(d.get("timing_s/ref", 0.0)),
        "update": float(d.get("timing_s/adv", 0.0)) + float(d["timing_s/update_actor"]),
        "weight_sync": float(d["timing_s/update_weights"]),
    }
    step_s = float(d["timing_s/step"])
    phases["other"] = max(0.0, step_s - sum(phases.values()))
    rm_scores = [_rm_score(t, mode) for t in trajectories]
    known = [s for s in rm_scores if s is not None]
    record: dict[str, Any] = {
        "step": int(d["training/global_step"]),
        "step_s": step_s,
        **{f"{name}_s": value for name, value in phases.items()},
        "mean_reward": float(d["critic/score/mean"]),
        "mean_rm_score": mean(known) if known else None,
        "trajectories": len(trajectories),
        "keys": [t["key"] for t in trajectories],
        "rewards": [float(t["reward"]) for t in trajectories],
        "rm_scores": rm_scores,
        "response_tokens": [int(t["response_tokens"]) for t in trajectories],
        "digests": [t.get("digest") for t in trajectories],
        "reward_waits_s": [float(t["reward_wait_s"]) for t in trajectories if t.get("reward_wait_s") is not None],
    }
    for key in ("async_rm/scored", "async_rm/errors", "async_rm/reward_tail_s", "async_rm/sleep_s", "async_rm/wake_s"):
        if key in d:
            record[key.replace("async_rm/", "plugin_")] = float(d[key])
    return record


def _mode_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [s for s in steps if s["step"] >= STEADY_FROM] or steps
    scores = [s["mean_rm_score"] for s in steps]
    out = {"steps": len(steps), "steady_steps": [s["step"] for s in steady],
           "step_s": mean(s["step_s"] for s in steady)}
    out.update({f"{name}_s": mean(s[f"{name}_s"] for s in steady) for name in PHASES})
    waits = sorted(w for s in steady for w in s["reward_waits_s"])  # each trajectory's agent-loop end to its reward
    out["reward_wait_p50_s"], out["reward_wait_p99_s"] = (
        (waits[(len(waits) - 1) // 2], waits[min(len(waits) - 1, math.ceil(0.99 * len(waits)) - 1)]) if waits
        else (None, None))
    out["rm_score_first"], out["rm_score_last"] = scores[0], scores[-1]
    out["rm_score_gain"] = None if scores[0] is None or scores[-1] is None else scores[-1] - scores[0]
    return out


def build_summary(config: Any, runs: Mapping[str, Any], *, env: dict[str, Any], wall_s: float, setup_s: float,
                  files: dict[str, str]) -> dict[str, Any]:
    """``summary.json``'s content from each mode's :class:`~verl_async_rm.demo.run.ModeRun`."""
    modes: dict[str, Any] = {}
    for name, run in runs.items():
        by_step: dict[int, list] = {}
        for t in run.trajectories:
            by_step.setdefault(int(t["step"]), []).append(t)
        steps = [step_record(row["data"], by_step.get(int(row["step"]), []), name)
                 for row in sorted(run.metrics, key=lambda r: r["step"])]
        modes[name] = {"label": LABELS[name], **_mode_summary(steps), "wall_s": run.wall_s,
                       "ray_left_behind": list(run.left_behind), "per_step": steps}
    return {
        "config": config.to_dict(),
        "environment": env,
        "wall_s": wall_s,
        "setup_s": setup_s,
        "modes": modes,
        "overhead_vs_no_rm": overhead(modes),
        "files": files,
    }


def overhead(modes: Mapping[str, Any]) -> dict[str, Any]:
    """Per mode with an RM: its step time minus the no-RM run's, per step (``per_step_s``, from
    :data:`STEADY_FROM`) and on average (``mean_s``, and ``share`` of the no-RM step time); {} without a no-RM run."""
    if "no_rm" not in modes:
        return {}
    floor = {s["step"]: s["step_s"] for s in modes["no_rm"]["per_step"]}
    out = {}
    for name, mode in modes.items():
        if name == "no_rm":
            continue
        per_step = {s["step"]: s["step_s"] - floor[s["step"]] for s in mode["per_step"]
                    if s["step"] >= STEADY_FROM and s["step"] in floor}
        if per_step:
            avg = mean(per_step.values())
            out[name] = {"per_step_s": per_step, "mean_s": avg, "share": avg / modes["no_rm"]["step_s"]}
    return out


def _fmt(value: float | None, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def format_report(summary: Mapping[str, Any]) -> str:
    """What the CLI prints: the mode table (steady means), the mean RM score per step, the per-step split."""
    modes, over = summary["modes"], summary["overhead_vs_no_rm"]
    cfg = summary["config"]
    steady = next(iter(modes.values()))["steady_steps"]
    lines = [f"GRPO with verl's own trainer ({cfg.get('trainer', 'v1')}), {cfg['steps']} steps x {cfg['prompts']} "
             f"prompts x {cfg['rollout_n']} responses per mode; mean seconds per step over steps "
             f"{steady[0]}-{steady[-1]}:"]
    head = (f"{'mode':<20}{'step':>7}{'rollout':>9}{'reward tail':>13}{'log-prob':>10}{'update':>8}"
            f"{'weight sync':>13}{'other':>7}{'RM overhead':>13}")
    lines += [head]
    for name, m in modes.items():
        extra = over.get(name)
        cost = "-" if extra is None else f"{extra['mean_s']:+.2f} ({100 * extra['share']:+.0f}%)"
        lines.append(f"{m['label']:<20}{m['step_s']:>7.2f}{m['rollout_s']:>9.2f}{m['reward_tail_s']:>13.2f}"
                     f"{m['log_prob_s']:>10.2f}{m['update_s']:>8.2f}{m['weight_sync_s']:>13.2f}{m['other_s']:>7.2f}"
                     f"{cost:>13}")
    lines += ["", "mean RM score per step (the demo RM: the share of vowel-initial tokens, x~10):",
              f"{'step':<6}" + "".join(f"{m['label']:>20}" for m in modes.values())]
    steps = max(len(m["per_step"]) for m in modes.values())
    for i in range(steps):
        cells = []
        for m in modes.values():
            per = m["per_step"]
            cells.append(_fmt(per[i]["mean_rm_score"]) if i < len(per) else "")
        lines.append(f"{i + 1:<6}" + "".join(f"{c:>20}" for c in cells))
    lines += ["", "each trajectory's reward tail (its agent loop's end to its reward, steady steps): p50 / p99 s"]
    lines += [f"  {m['label']}: {_fmt(m['reward_wait_p50_s'], '{:.3f}')} / {_fmt(m['reward_wait_p99_s'], '{:.3f}')}"
              for m in modes.values()]
    for name, m in modes.items():
        if m["rm_score_gain"] is not None:
            lines.append(f"{m['label']}: RM score {m['rm_score_first']:.2f} at step 1 -> {m['rm_score_last']:.2f} at "
                         f"step {m['steps']} ({m['rm_score_gain']:+.2f})")
    lines += ["", "per step (s): step / rollout / reward tail / log-prob / update / weight sync / other; RM score; "
                  "RM overhead vs no RM"]
    for name, m in modes.items():
        lines.append(f"{m['label']}:")
        per_over = (over.get(name) or {}).get("per_step_s", {})
        for s in m["per_step"]:
            split = " / ".join(f"{s[f'{p}_s']:.2f}" for p in PHASES)
            cost = per_over.get(s["step"])
            lines.append(f"  step {s['step']:>2}: {s['step_s']:5.2f} = {split}; RM score {_fmt(s['mean_rm_score'])}"
                         + ("" if cost is None else f"; overhead {cost:+.2f}"))
    return "\n".join(lines)
