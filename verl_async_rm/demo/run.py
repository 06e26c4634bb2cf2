"""``verl-async-rm demo``: GRPO with verl's own trainer on this CPU machine, once per mode, with the same data, seeds
and steps; the RM's cost per step against the run with no RM, and the RM score the policy learns to raise.

Each mode (:mod:`verl_async_rm.demo.modes`) is one ``python -m verl.trainer.main_ppo`` run in a subprocess, as a user
launches verl: its own Ray cluster (logical GPUs for verl's pools), verl's v1 sync trainer, verl's vLLM rollout (the
demo's agent loop: heavy-tailed response lengths, sampled), the FSDP2 actor and reference, the weight sync after each
update, and the reward of the mode. verl's ``Tracking`` writes every step's metrics (``metrics.jsonl``, verl's file
logger); the demo's replay buffer (:mod:`verl_async_rm.demo.sampler`) adds the rollout and reward-tail times and
writes each trajectory's reward (``trajectories.jsonl``). Afterwards the demo checks that no process of the run's Ray
cluster is left (by its temp dir; one left is terminated by pid and reported), and writes ``summary.json`` and
``reward_curve.png`` (:mod:`verl_async_rm.demo.summary`, :mod:`verl_async_rm.demo.plot`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from verl_async_rm.demo.options import DemoConfig

logger = logging.getLogger(__name__)

__all__ = ["DemoResult", "ModeRun", "default_out_dir", "run_demo", "run_mode"]

#: Files each mode's folder gets.
METRICS, TRAJECTORIES, LOG = "metrics.jsonl", "trajectories.jsonl", "main_ppo.log"


@dataclass(frozen=True)
class DemoResult:
    """Where the demo wrote its files, and the summary it wrote."""

    out_dir: Path
    summary_path: Path
    plot_path: Path
    summary: dict[str, Any]

    def table(self) -> str:
        from verl_async_rm.demo.summary import format_report

        return format_report(self.summary)


@dataclass
class ModeRun:
    """One mode's ``main_ppo`` run: verl's step metrics, the trajectories' rewards, its wall time, the Ray processes
    that outlived it."""

    mode: str
    metrics: list[dict[str, Any]]
    trajectories: list[dict[str, Any]]
    wall_s: float
    left_behind: list[int]


def default_out_dir() -> Path:
    """A fresh ``./async_rm_demo/<UTC timestamp>`` folder name (absolute: see :func:`out_dir_of`)."""
    return (Path("async_rm_demo") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")).resolve()


def out_dir_of(config: DemoConfig) -> Path:
    """The demo's folder as an absolute path: each mode's ``main_ppo`` runs in its own folder, and verl's workers
    resolve the paths the demo passes them (the agent-loop file, the records) from theirs."""
    return Path(config.out_dir).resolve() if config.out_dir else default_out_dir()


def run_demo(config: DemoConfig | None = None) -> DemoResult:
    """Run every mode of ``config`` (module doc) and return what the demo wrote; raises on a failed mode."""
    from verl_async_rm.demo.agent_loop import write_agent_loop_config
    from verl_async_rm.demo.data import demo_assets
    from verl_async_rm.demo.plot import plot_training
    from verl_async_rm.demo.summary import build_summary, environment
    from verl_async_rm.vllm_cpu import vllm_unavailable_reason

    import warnings

    # verl announces every optional training engine it cannot import (megatron, torchtitan...): noise here
    warnings.filterwarnings("ignore", message=".*engine is not available", category=UserWarning)
    config = config or DemoConfig()
    reason = vllm_unavailable_reason()
    if reason:
        raise RuntimeError(f"the demo trains with verl's vLLM rollout, and {reason}")
    start = time.perf_counter()
    out_dir = out_dir_of(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = config.mode_list()
    with _progress(len(modes) * config.steps, config.progress) as bar:
        bar.set_description("build models and data")
        assets = demo_assets(config.cache_dir, seed=config.seed, rm_hidden_size=config.rm_hidden_size,
                             rm_layers=config.rm_layers, train_prompts=max(256, config.steps * config.prompts))
        loops = write_agent_loop_config(out_dir / "agent_loops.yaml", median_tokens=config.median_tokens,
                                        sigma=config.sigma, seed=config.seed, greedy=False)
        setup_s = time.perf_counter() - start
        runs = {mode: run_mode(mode, config, assets, loops, out_dir / mode, bar) for mode in modes}
    plot_path, summary_path = out_dir / "reward_curve.png", out_dir / "summary.json"
    summary = build_summary(config, runs, env=environment(), wall_s=time.perf_counter() - start, setup_s=setup_s,
                            files={"reward_curve_png": str(plot_path), "summary_json": str(summary_path)})
    plot_training(summary, plot_path)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return DemoResult(out_dir=out_dir, summary_path=summary_path, plot_path=plot_path, summary=summary)


def run_mode(mode: str, config: DemoConfig, assets: Any, agent_loops: Path, folder: Path, bar: Any = None) -> ModeRun:
    """One mode's ``python -m verl.trainer.main_ppo`` run in ``folder`` (its log, metrics and trajectories there)."""
    from verl_async_rm.demo.modes import mode_overrides
    from verl_async_rm.testing.cpu_trainer import cpu_env

    folder.mkdir(parents=True, exist_ok=True)
    for name in (METRICS, TRAJECTORIES):
        (folder / name).unlink(missing_ok=True)
    # Ray's sockets live under its temp dir: a short path (a Unix socket path holds ~100 characters)
    ray_dir = tempfile.mkdtemp(prefix="vard", dir="/tmp")
    overrides = mode_overrides(mode, config, assets, agent_loops=agent_loops, record_path=folder / TRAJECTORIES,
                               ray_temp_dir=ray_dir)
    env = cpu_env()
    env.update(VERL_FILE_LOGGER_PATH=str(folder / METRICS), RAY_DEDUP_LOGS="0", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    (folder / "command.json").write_text(json.dumps([sys.executable, "-m", "verl.trainer.main_ppo", *overrides],
                                                    indent=1) + "\n")
    start = time.perf_counter()
    done = 0
    with open(folder / LOG, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cwd=folder, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.perf_counter() - start > config.mode_timeout_s:
                    raise TimeoutError(f"demo mode {mode} ran past mode_timeout_s={config.mode_timeout_s:g}s; its "
                                       f"log: {folder / LOG}")
                steps = _count_lines(folder / METRICS)
                if bar is not None:
                    bar.set_description(f"{mode}: " + (f"step {steps}/{config.steps}" if steps else "start-up"))
                    bar.update(steps - done)
                done = steps
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
                proc.wait(timeout=60)
    wall_s = time.perf_counter() - start
    left = _reap(ray_dir)
    shutil.rmtree(ray_dir, ignore_errors=True)
    if proc.returncode != 0:
        tail = (folder / LOG).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"demo mode {mode}: main_ppo exited with {proc.returncode}; log {folder / LOG}:\n{tail}")
    if bar is not None:
        bar.update(config.steps - done)
    return ModeRun(mode=mode, metrics=_read_jsonl(folder / METRICS), trajectories=_read_jsonl(folder / TRAJECTORIES),
                   wall_s=wall_s, left_behind=left)


def _count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _reap(ray_dir: str, wait_s: float = 30.0) -> list[int]:
    """Pids of the run's Ray processes (their command lines name its temp dir) still alive ``wait_s`` after the run
    ended; each is terminated (by pid). Other Ray clusters on the machine have other temp dirs."""
    import psutil

    def ours() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if ray_dir in " ".join(proc.info["cmdline"] or []):
                    found.append(proc)
        return found

    deadline = time.monotonic() + wait_s
    while ours() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = ours()
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    if left:
        logger.warning("demo: %d Ray process(es) of %s outlived their run; terminated %s", len(left), ray_dir,
                       [p.pid for p in left])
    return [p.pid for p in left]


@contextlib.contextmanager
def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    bar = tqdm(total=total, file=sys.stderr, disable=not enabled, unit="step", dynamic_ncols=True,
               bar_format="{desc:<28} {bar} {n_fmt}/{total_fmt} [{elapsed}]")
    try:
        yield bar
    finally:
        bar.close()
