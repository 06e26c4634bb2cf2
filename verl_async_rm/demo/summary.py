"""The demo's JSON summary (stable keys) and the text table the CLI prints."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from verl_async_rm.demo.timeline import MODE_KEYS, StepTimeline, mode_summary, speedup

__all__ = ["SCHEMA_VERSION", "SUMMARY_KEYS", "build_summary", "environment", "format_table", "score_agreement",
           "write_summary"]

SCHEMA_VERSION = 2
#: Top-level keys of ``summary.json``.
SUMMARY_KEYS = ("schema", "config", "environment", "modes", "speedup", "agreement", "wall_s", "files", "ray")


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
        "verl_async_rm": version("verl-async-rm"),
        "verl": version("verl"),
        "ray": version("ray"),
        "torch": version("torch"),
        "vllm": version("vllm"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "argv": list(sys.argv),
    }


def build_summary(
    modes: Mapping[str, Sequence[StepTimeline]],
    *,
    config: Mapping[str, Any],
    env: Mapping[str, Any],
    wall_s: float,
    files: Mapping[str, str],
    ray_info: Mapping[str, Any],
) -> dict[str, Any]:
    """The summary dict (keys :data:`SUMMARY_KEYS`); per mode: :data:`MODE_KEYS` plus ``"per_step"``."""
    mode_figures = {name: {**mode_summary(steps), "per_step": [s.to_dict() for s in steps]}
                    for name, steps in modes.items()}
    return {
        "schema": SCHEMA_VERSION,
        "config": dict(config),
        "environment": dict(env),
        "modes": mode_figures,
        "speedup": speedup(mode_figures),
        "agreement": {f"{a}_vs_{b}": score_agreement(modes[a], modes[b])
                      for a, b in AGREEMENT_PAIRS if a in modes and b in modes},
        "wall_s": wall_s,
        "files": dict(files),
        "ray": dict(ray_info),
    }


#: Mode pairs whose RM scores are compared trajectory by trajectory (``summary["agreement"]``).
AGREEMENT_PAIRS = (("async", "sync"), ("async", "verl_served"), ("async", "async_vllm"), ("async_vllm", "verl_served"))
_AGREEMENT_TITLES = {
    "async_vs_verl_served": "the plugin vs verl's served RM",
    "async_vs_async_vllm": "the plugin on transformers vs on vLLM",
    "async_vllm_vs_verl_served": "the plugin on vLLM vs verl's served RM",
}


def score_agreement(a: Sequence[StepTimeline], b: Sequence[StepTimeline]) -> dict[str, Any]:
    """RM scores of two modes, trajectory by trajectory (same step, same place), where both scored the same response.

    ``compared`` of ``trajectories`` had equal response digests; ``max_abs_diff`` is over those (None if none).
    """
    diffs, total = [], 0
    for sa, sb in zip(a, b, strict=True):
        total += len(sa.rm_scores)
        if len(sa.responses) == len(sa.rm_scores) == len(sb.responses) == len(sb.rm_scores):
            diffs += [abs(x - y) for ra, rb, x, y in zip(sa.responses, sb.responses, sa.rm_scores, sb.rm_scores)
                      if ra == rb]
    return {"trajectories": total, "compared": len(diffs), "max_abs_diff": max(diffs) if diffs else None}


def write_summary(summary: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Write ``summary`` as indented JSON (NaN/inf become null) and return the path."""
    out = os.fspath(path)
    with open(out, "w") as f:
        json.dump(_clean(summary), f, indent=2, allow_nan=False)
        f.write("\n")
    return out


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


_COLUMNS = (
    ("mode", "mode", "{}"),
    ("steps", "steps", "{}"),
    ("step_time_s", "step time (s)", "{:.2f}"),
    ("reward_tail_s", "reward tail (s)", "{:.2f}"),
    ("rm_utilization", "RM util", "{:.0%}"),
    ("rm_busy_per_trajectory_ms", "RM busy/traj (ms)", "{:.1f}"),
    ("batches", "batches", "{}"),
    ("mean_batch_size", "mean batch", "{:.1f}"),
)
assert {key for key, _, _ in _COLUMNS} - {"mode"} <= set(MODE_KEYS)


def format_table(summary: Mapping[str, Any]) -> str:
    """A short fixed-width table, one row per mode, then the speed-up line."""
    header = [title for _, title, _ in _COLUMNS]
    rows = []
    for name, figures in summary["modes"].items():
        row = []
        for key, _, fmt in _COLUMNS:
            value = name if key == "mode" else figures.get(key)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for name, agree in (summary.get("agreement") or {}).items():
        if name in _AGREEMENT_TITLES:
            diff = agree["max_abs_diff"]
            lines.append(f"RM scores, {_AGREEMENT_TITLES[name]}: {agree['compared']}/{agree['trajectories']} "
                         f"same responses, max |diff| {'-' if diff is None else f'{diff:.1e}'}")
    for mine, title in (("async", "the plugin's"), ("async_vllm", "the plugin's on vLLM")):
        served, asy = (summary["modes"].get(m, {}).get("step_time_s") for m in ("verl_served", mine))
        if served and asy:
            lines.append(f"verl's served RM step time / {title}: {served / asy:.2f}x")
    s = summary.get("speedup")
    lines.append(f"speed-up (sync step time / async step time): {'-' if s is None else f'{s:.2f}x'}")
    return "\n".join(lines)
