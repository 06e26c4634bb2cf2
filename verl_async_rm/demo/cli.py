"""The ``demo`` subcommand's options (built from :class:`DemoConfig`'s fields) and its printed report."""

from __future__ import annotations

import argparse
import dataclasses

from verl_async_rm.demo.options import DemoConfig

__all__ = ["add_demo_arguments", "config_from_args", "report"]

_FLAGS = {"out_dir": "--out"}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per :class:`DemoConfig` field (``--modes``, ``--steps``, ``--out``, ``--no-progress``...)."""
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
    """What the CLI prints at the end: the tables, the Ray clean-up, the wall time, the output folder."""
    summary = result.summary
    lines = [result.table(), ""]
    left = {name: m["ray_left_behind"] for name, m in summary["modes"].items() if m["ray_left_behind"]}
    lines.append("every mode's Ray cluster shut down, no process left" if not left
                 else f"Ray processes left (terminated): {left}")
    env = summary["environment"]
    load = env.get("load_average")
    runs = ", ".join(f"{name} {m['wall_s']:.0f} s" for name, m in summary["modes"].items())
    lines.append(f"demo time {summary['wall_s'] - summary['setup_s']:.0f} s ({runs}; set-up {summary['setup_s']:.0f} s"
                 f") on {env['cpu_count']} CPU(s)" + (f", load average {load[0]:.2f}" if load else ""))
    lines.append(f"wrote {result.plot_path} and {result.summary_path}")
    lines.append(f"output folder: {result.out_dir.resolve()}")
    return "\n".join(lines)
