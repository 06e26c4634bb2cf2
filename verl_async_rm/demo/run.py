"""``verl-async-rm demo``: the same rollout steps with the RM scored as each trajectory ends, then after the rollout.

On a CPU machine with nothing but this package: builds the tiny models (and the demo RM) if missing, starts its own
local Ray cluster and verl's TransferQueue, builds the plugin's :class:`~verl_async_rm.AsyncRMAgentLoopManager` as
verl's v1 trainer (the default, ``trainer.use_v1=True``) does (after verl's ``RewardLoopManager``), plus verl's plain
``AgentLoopManagerTQ`` for the synchronous mode, gives each its own v1 fit loop
(:class:`~verl_async_rm.testing.V1FitLoop`, same replay-buffer polling period), and runs each step once per mode on
the same prompts (the synthetic CPU generation server gives them the same heavy-tailed lengths in both modes). One
warm-up step per mode is run first and not counted. It writes ``timeline.png`` and ``summary.json`` to the output
folder, closes TransferQueue and shuts the cluster down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from verl_async_rm.demo.cluster import local_cluster
from verl_async_rm.demo.options import DemoConfig
from verl_async_rm.demo.timeline import StepTimeline

logger = logging.getLogger(__name__)

__all__ = ["DemoResult", "TRAINER", "default_out_dir", "run_demo", "summary_config"]

_WARMUP_SIZE = 2
#: The verl trainer the demo runs (recorded in ``summary.json``'s config).
TRAINER = "v1"


@dataclass(frozen=True)
class DemoResult:
    """Where the demo wrote its files, and the summary it wrote."""

    out_dir: Path
    summary_path: Path
    timeline_path: Path
    summary: dict[str, Any]

    def table(self) -> str:
        from verl_async_rm.demo.summary import format_table

        return format_table(self.summary)


def default_out_dir() -> Path:
    """A fresh ``./async_rm_demo/<UTC timestamp>`` folder name."""
    return Path("async_rm_demo") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")


def _fit_transfer_queue_threads() -> None:
    """TransferQueue asks for 8 torch threads per call (``TQ_NUM_THREADS``) and warns at every call of a step when
    the machine has fewer physical cores: ask for what there is (read at its import, here and in the Ray workers this
    process starts). A value the user set is kept."""
    import psutil

    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))


def run_demo(config: DemoConfig | None = None) -> DemoResult:
    """Run the demo (see module doc) and return what it wrote; raises on any failure, after shutting Ray down."""
    config = config or DemoConfig()
    start = time.perf_counter()
    out_dir = Path(config.out_dir) if config.out_dir else default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 4 + 2 * config.steps
    _fit_transfer_queue_threads()
    with warnings.catch_warnings(), _progress(total, config.progress) as bar:
        # verl warns about every optional training engine it cannot import: noise next to the progress bar
        warnings.filterwarnings("ignore", message=".*engine is not available", category=UserWarning)
        bar.set_description("import verl")
        import verl  # noqa: F401  (loads the verl.plugins entry point)

        if "verl_async_rm.plugin" not in sys.modules:
            raise RuntimeError(
                "import verl did not load the verl_async_rm plugin: is the package installed (pip install -e .) and "
                "VERL_USE_EXTERNAL_PLUGINS unset or 'auto'?"
            )
        from verl_async_rm.demo.models import build_demo_rm
        from verl_async_rm.demo.workload import PROMPT_LENGTH, verl_overrides
        from verl_async_rm.testing import build_tiny_models, compose_trainer_config

        bar.set_description("build models")
        tiny = build_tiny_models(config.cache_dir, seed=config.seed)
        rm_path = build_demo_rm(tiny, hidden_size=config.rm_hidden_size, num_layers=config.rm_layers,
                                seed=config.seed)
        trainer_config = compose_trainer_config(
            tiny.policy, trainer=TRAINER, prompt_length=PROMPT_LENGTH, response_length=config.response_length,
            num_workers=1, overrides=verl_overrides(config, str(rm_path)),
        )
        bar.update(1)
        bar.set_description("start Ray")
        with local_cluster() as cluster:
            bar.update(1)
            modes = _run_modes(config, trainer_config, tiny, bar)
            cluster.track()
        wall_s = time.perf_counter() - start
        bar.set_description("write files")
        result = _write(config, out_dir, modes, wall_s, cluster.to_dict())
        bar.update(1)
        bar.set_description("done")
    return result


def _run_modes(config: DemoConfig, trainer_config: Any, tiny: Any, bar: Any) -> dict[str, list[StepTimeline]]:
    import transfer_queue as tq

    tq.init(trainer_config.transfer_queue)
    try:
        return _run_with_transfer_queue(config, trainer_config, tiny, bar)
    finally:
        tq.close()


def _run_with_transfer_queue(config: DemoConfig, trainer_config: Any, tiny: Any,
                             bar: Any) -> dict[str, list[StepTimeline]]:
    import ray
    from transformers import AutoTokenizer

    from verl_async_rm.demo.modes import fit_loop, rule_scorer, run_async_step, run_sync_step
    from verl_async_rm.demo.workload import prompts_batch, server_kwargs
    from verl_async_rm.testing import make_llm_client, start_generation_servers

    bar.set_description("start RM replicas, agent loops")
    servers = start_generation_servers(1, name_prefix="demo_gen", **server_kwargs(config, str(tiny.policy)))
    server = next(iter(servers.values()))
    actors: list[Any] = list(servers.values())
    managers: list[Any] = []
    try:
        manager, plain = _start_managers(trainer_config, make_llm_client(trainer_config, servers), actors, managers,
                                         config.step_timeout_s)
        async_loop, sync_loop = fit_loop(trainer_config, manager), fit_loop(trainer_config, plain)
        mix = manager.async_rm_config.mix  # parsed once, by the manager
        rule = rule_scorer(AutoTokenizer.from_pretrained(tiny.policy))
        bar.update(1)

        def async_step(step: int, size: int, tag: str = "step") -> StepTimeline:
            return run_async_step(async_loop, manager, server, prompts_batch(step, size, tag=tag, mode="async"), step)

        def sync_step(step: int, size: int, tag: str = "step") -> StepTimeline:
            return run_sync_step(sync_loop, server, manager.rm_service,  # the same replicas
                                 manager.async_rm_config.rm.num_replicas,
                                 prompts_batch(step, size, tag=tag, mode="sync"), step,
                                 rule_score=rule, mix=mix, timeout_s=config.step_timeout_s)

        return _run_steps(config, async_step, sync_step, bar)
    finally:
        for started in managers:
            started.shutdown()
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


def _start_managers(trainer_config: Any, client: Any, actors: list[Any], managers: list[Any],
                    timeout_s: float) -> tuple[Any, Any]:
    """The plugin's v1 manager (after verl's ``RewardLoopManager``, as verl's trainer builds it) and verl's plain
    ``AgentLoopManagerTQ`` with no reward-loop workers (verl's v1 trainer then scores after sampling,
    ``_compute_reward_colocate``). What they start is appended to ``actors`` / ``managers`` as it is started."""
    import ray
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ

    from verl_async_rm import AsyncRMAgentLoopManager

    reward_loop = RewardLoopManager(config=trainer_config, rm_resource_pool=None)
    actors += reward_loop.reward_loop_workers
    manager = AsyncRMAgentLoopManager.create(
        config=trainer_config, llm_client=client, teacher_client=None,
        reward_loop_worker_handles=reward_loop.reward_loop_worker_handles,
    )
    managers.append(manager)
    actors += manager.agent_loop_workers
    plain = AgentLoopManagerTQ.create(config=trainer_config, llm_client=client, teacher_client=None,
                                      reward_loop_worker_handles=None)
    actors += plain.agent_loop_workers
    ray.get([w.__ray_ready__.remote() for w in plain.agent_loop_workers], timeout=timeout_s)
    return manager, plain


def _run_steps(config: DemoConfig, async_step: Any, sync_step: Any, bar: Any) -> dict[str, list[StepTimeline]]:
    """One untimed warm-up step per mode, then each step once per mode (async first), on the same prompts."""
    bar.set_description("warm-up")
    async_step(0, _WARMUP_SIZE, tag="warmup")
    sync_step(0, _WARMUP_SIZE, tag="warmup")
    modes: dict[str, list[StepTimeline]] = {"async": [], "sync": []}
    for step in range(1, config.steps + 1):
        bar.set_description(f"step {step}/{config.steps} async")
        modes["async"].append(async_step(step, config.batch_size))
        bar.update(1)
        bar.set_description(f"step {step}/{config.steps} sync")
        modes["sync"].append(sync_step(step, config.batch_size))
        bar.update(1)
    return modes


def summary_config(config: DemoConfig) -> dict[str, Any]:
    """The ``config`` section of ``summary.json``: the demo's settings, the verl trainer and the polling period."""
    from verl_async_rm.demo.modes import POLL_INTERVAL_S

    return {**config.to_dict(), "trainer": TRAINER, "replay_buffer_poll_interval_s": POLL_INTERVAL_S}


def _write(config: DemoConfig, out_dir: Path, modes: dict[str, list[StepTimeline]], wall_s: float,
           ray_info: dict[str, Any]) -> DemoResult:
    from verl_async_rm.demo.plot import plot_timeline
    from verl_async_rm.demo.summary import build_summary, environment, write_summary

    timeline_path = out_dir / "timeline.png"
    summary_path = out_dir / "summary.json"
    plot_timeline(modes, timeline_path)
    summary = build_summary(
        modes, config=summary_config(config), env=environment(), wall_s=wall_s,
        files={"timeline_png": str(timeline_path), "summary_json": str(summary_path)}, ray_info=ray_info,
    )
    write_summary(summary, summary_path)
    return DemoResult(out_dir=out_dir, summary_path=summary_path, timeline_path=timeline_path, summary=summary)


@contextlib.contextmanager
def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    bar = tqdm(total=total, file=sys.stderr, disable=not enabled, unit="phase", dynamic_ncols=True,
               bar_format="{desc:<34} {bar} {n_fmt}/{total_fmt} [{elapsed}]")
    try:
        yield bar
    finally:
        bar.close()
