"""``verl-async-rm demo``: the same rollout steps with the RM scored as each trajectory ends, then after the rollout.

On a CPU machine with nothing but this package: builds the tiny models (and the demo RM) if missing, starts its own
local Ray cluster, builds the plugin's :class:`~verl_async_rm.AsyncRMAgentLoopManager` as verl's v0 trainer does
(after verl's ``RewardLoopManager``), plus verl's plain ``AgentLoopManager`` for the synchronous mode, and runs each
step once per mode on the same prompts (the synthetic CPU generation server gives them the same heavy-tailed lengths
in both modes). One warm-up step per mode is run first and not counted. It writes ``timeline.png`` and
``summary.json`` to the output folder and shuts the cluster down.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from verl_async_rm.demo.cluster import local_cluster
from verl_async_rm.demo.config import DemoConfig
from verl_async_rm.demo.timeline import StepTimeline

logger = logging.getLogger(__name__)

__all__ = ["DemoResult", "default_out_dir", "run_demo"]

_WARMUP_SIZE = 2


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


def run_demo(config: DemoConfig | None = None) -> DemoResult:
    """Run the demo (see module doc) and return what it wrote; raises on any failure, after shutting Ray down."""
    config = config or DemoConfig()
    start = time.perf_counter()
    out_dir = Path(config.out_dir) if config.out_dir else default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 4 + 2 * config.steps
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
            tiny.policy, trainer="v0", prompt_length=PROMPT_LENGTH, response_length=config.response_length,
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
    import ray
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.experimental.reward_loop import RewardLoopManager

    from verl_async_rm import AsyncRMAgentLoopManager
    from verl_async_rm.config import AsyncRMConfig
    from verl_async_rm.demo.modes import run_async_step, run_sync_step
    from verl_async_rm.demo.workload import prompts_batch, server_kwargs
    from verl_async_rm.testing import make_llm_client, start_generation_servers

    bar.set_description("start RM replicas, agent loops")
    servers = start_generation_servers(1, name_prefix="demo_gen", **server_kwargs(config, str(tiny.policy)))
    server = next(iter(servers.values()))
    client = make_llm_client(trainer_config, servers)
    actors: list[Any] = list(servers.values())
    manager = None
    try:
        reward_loop = RewardLoopManager(config=trainer_config, rm_resource_pool=None)
        actors += reward_loop.reward_loop_workers
        manager = AsyncRMAgentLoopManager.create(
            config=trainer_config, llm_client=client, teacher_client=None,
            reward_loop_worker_handles=reward_loop.reward_loop_worker_handles,
        )
        actors += manager.agent_loop_workers
        plain = AgentLoopManager.create(config=trainer_config, llm_client=client, teacher_client=None,
                                        reward_loop_worker_handles=None)
        actors += plain.agent_loop_workers
        ray.get([w.__ray_ready__.remote() for w in plain.agent_loop_workers], timeout=config.step_timeout_s)
        replicas = list(manager.replicas)
        mix = AsyncRMConfig.from_verl(trainer_config).mix
        rule = _rule_scorer(AutoTokenizer.from_pretrained(tiny.policy))
        bar.update(1)

        def sync_step(prompts, step):
            return run_sync_step(plain, server, replicas, prompts, step, rule_score=rule, mix=mix,
                                 timeout_s=config.step_timeout_s)

        bar.set_description("warm-up")
        run_async_step(manager, server, prompts_batch(0, _WARMUP_SIZE, tag="warmup"), 0)
        sync_step(prompts_batch(0, _WARMUP_SIZE, tag="warmup"), 0)
        modes: dict[str, list[StepTimeline]] = {"async": [], "sync": []}
        for step in range(1, config.steps + 1):
            bar.set_description(f"step {step}/{config.steps} async")
            modes["async"].append(run_async_step(manager, server, prompts_batch(step, config.batch_size), step))
            bar.update(1)
            bar.set_description(f"step {step}/{config.steps} sync")
            modes["sync"].append(sync_step(prompts_batch(step, config.batch_size), step))
            bar.update(1)
        return modes
    finally:
        if manager is not None:
            manager.shutdown()
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


def _rule_scorer(tokenizer: Any):
    """Row ``i``'s rule score, decoded and computed as verl's reward manager does (``NaiveRewardManager``)."""
    from verl_async_rm.demo import rule

    def score(output: Any, i: int) -> float:
        width = output.batch["prompts"].shape[1]
        n = int(output.batch["attention_mask"][i, width:].sum())
        text = tokenizer.decode(output.batch["responses"][i][:n], skip_special_tokens=True)
        gt = output.non_tensor_batch["reward_model"][i]["ground_truth"]
        return float(rule.compute_score(output.non_tensor_batch["data_source"][i], text, gt)["score"])

    return score


def _write(config: DemoConfig, out_dir: Path, modes: dict[str, list[StepTimeline]], wall_s: float,
           ray_info: dict[str, Any]) -> DemoResult:
    from verl_async_rm.demo.plot import plot_timeline
    from verl_async_rm.demo.summary import build_summary, environment, write_summary

    timeline_path = out_dir / "timeline.png"
    summary_path = out_dir / "summary.json"
    plot_timeline(modes, timeline_path)
    summary = build_summary(
        modes, config=config.to_dict(), env=environment(), wall_s=wall_s,
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
