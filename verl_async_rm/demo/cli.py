"""The ``demo`` subcommand's options (built from :class:`DemoConfig`'s fields) and its printed report."""

from __future__ import annotations

import argparse
import dataclasses

from verl_async_rm.demo.options import DemoConfig

__all__ = ["add_demo_arguments", "config_from_args", "report"]

_FLAGS = {"out_dir": "--out"}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per :class:`DemoConfig` field (``--steps``, ``--batch-size``, ``--out``, ``--no-progress``...)."""
    for f in dataclasses.fields(DemoConfig):
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            parser.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false",
                                help=f"turn off: {help_text}")
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        flag = _FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        parser.add_argument(flag, dest=f.name, type=kind, default=f.default,
                            help=f"{help_text} (default: {f.default})")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)})


def report(result) -> str:
    """What the CLI prints at the end: the table, the figures that matter, the output folder."""
    summary = result.summary
    lines = [result.table(), ""]
    if summary["config"].get("trainer"):
        lines.append(_trainer_line(summary["config"]))
    for name, mode in summary["modes"].items():
        rewards = [r for s in mode["per_step"] for r in s["rewards"]]
        lines.append(f"{name:>11}: {len(rewards)} trajectories scored, mean reward "
                     f"{sum(rewards) / max(1, len(rewards)):.3f}")
    env = summary["environment"]
    load = env.get("load_average")
    lines.append(f"wall time {summary['wall_s']:.0f} s on {env['cpu_count']} CPU(s)"
                 + (f", load average {load[0]:.2f}" if load else ""))
    left = summary["ray"]["left_behind"]
    lines.append("Ray cluster shut down, no process left" if not left else f"Ray processes left: {left}")
    lines.append(f"wrote {result.timeline_path} and {result.summary_path}")
    lines.append(f"output folder: {result.out_dir.resolve()}")
    return "\n".join(lines)


def _trainer_line(config) -> str:
    """Which verl trainer and rollout ran the modes, and how often the replay buffer polled TransferQueue."""
    poll = config.get("replay_buffer_poll_interval_s")
    line = f"verl {config['trainer']} trainer"
    line = line if poll is None else f"{line}, replay buffer polling TransferQueue every {poll:g} s in every mode"
    rollout = {"vllm": "verl's own vLLM rollout (vLLMReplica, vLLM's CPU build)",
               "standin": "the CPU stand-in rollout server (simulated decode time)"}.get(config.get("rollout"))
    if rollout:
        line += f"\nrollout: {rollout}"
    return line + (f"\nnote: {config['rollout_note']}" if config.get("rollout_note") else "")
