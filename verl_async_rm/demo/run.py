"""``verl-async-rm demo``: the same rollout steps scored four ways: the plugin (on transformers, on vLLM), after the
rollout, verl's served RM.

On a CPU machine with nothing but this package (and vLLM's CPU build, which ``scripts/env.sh`` installs): builds the
tiny models (and the demo RM) if missing, starts its own local Ray cluster (with logical GPUs for verl's vLLM pools)
and verl's TransferQueue, starts verl's own ``vLLMReplica`` for the tiny policy behind verl's router, builds

- the plugin's :class:`~verl_async_rm.AsyncRMAgentLoopManager` as verl's v1 trainer (the default,
  ``trainer.use_v1=True``) does (after verl's ``RewardLoopManager``): mode ``async``; the same with its replicas on
  vLLM's pooling engine (``+async_rm.engine=vllm``): mode ``async_vllm``;
- verl's plain ``AgentLoopManagerTQ`` with no reward-loop workers, scored on the same RM replicas after the rollout:
  mode ``sync``;
- verl's plain ``AgentLoopManagerTQ`` with verl's own vLLM-served RM on a pool of its own, one engine per plugin
  replica (:mod:`verl_async_rm.demo.served_rm`): mode ``verl_served``;

gives each its own v1 fit loop (:class:`~verl_async_rm.testing.V1FitLoop`, same replay-buffer polling period), and
runs each step once per mode on the same prompts. The demo's agent loop (:mod:`verl_async_rm.demo.agent_loop`) gives
every trajectory a heavy-tailed length of its own and decodes greedily, so every mode scores the same responses.
One warm-up step per mode is run first and not counted. It writes ``timeline.png`` and ``summary.json`` to the output
folder, closes TransferQueue and shuts the cluster down. Without vLLM (``--rollout-backend standin``, or ``auto``
where vLLM is missing) the CPU stand-in server generates and ``async_vllm`` and ``verl_served`` are skipped, with the
reason printed.
The rollout and the RM get half of the cores each (:mod:`verl_async_rm.demo.cores`), as a cluster gives them GPUs of
their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence
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
    total = 4 + 3 * config.steps  # corrected once the rollout is chosen
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
        from verl_async_rm.testing import build_tiny_models

        rollout, why = choose_rollout(config.rollout_backend)
        if why:
            logger.warning("%s", why)
        bar.total = 4 + (4 if rollout == "vllm" else 2) * config.steps  # the modes this run has
        bar.set_description("build models")
        tiny = build_tiny_models(config.cache_dir, seed=config.seed)
        rm_path = build_demo_rm(tiny, hidden_size=config.rm_hidden_size, num_layers=config.rm_layers,
                                seed=config.seed)
        configs = _trainer_configs(config, tiny, str(rm_path), out_dir, vllm=rollout == "vllm")
        bar.update(1)
        bar.set_description("start Ray")
        if rollout == "vllm":
            from verl_async_rm.testing.vllm_rollout import set_vllm_env

            set_vllm_env()
        with local_cluster(num_gpus=1 + config.rm_replicas if rollout == "vllm" else 0) as cluster:
            bar.update(1)
            modes, cores = _run_modes(config, configs, tiny, bar)
            cluster.track()
        wall_s = time.perf_counter() - start
        bar.set_description("write files")
        result = _write(config, out_dir, modes, wall_s, cluster.to_dict(), rollout=rollout, rollout_note=why,
                        cores=cores)
        bar.update(1)
        bar.set_description("done")
    return result


def choose_rollout(asked: str) -> tuple[str, str | None]:
    """``(rollout, note)``: ``vllm`` or ``standin`` for ``DemoConfig.rollout_backend``, and why vLLM is not used (or
    None).

    Raises ``RuntimeError`` for ``vllm`` where vLLM cannot run, naming the reason and the fix.
    """
    from verl_async_rm.vllm_cpu import vllm_unavailable_reason

    if asked == "standin":
        return "standin", ("--rollout-backend standin: the CPU stand-in server generates; verl's served RM (vLLM) is "
                           "skipped")
    reason = vllm_unavailable_reason()
    if reason is None:
        return "vllm", None
    if asked == "vllm":
        raise RuntimeError(f"demo --rollout-backend vllm: {reason}")
    return "standin", (f"vLLM cannot run here ({reason}): the CPU stand-in server generates and the verl_served mode "
                       "is skipped")


def _trainer_configs(config: DemoConfig, tiny: Any, rm_path: str, out_dir: Path, *, vllm: bool) -> dict[str, Any]:
    """verl's trainer config of the plugin's modes (``plugin``) and, on vLLM, of verl's served RM (``served``)."""
    from verl_async_rm.demo.agent_loop import write_agent_loop_config
    from verl_async_rm.demo.workload import PROMPT_LENGTH, rollout_overrides, served_overrides, verl_overrides
    from verl_async_rm.testing import compose_trainer_config

    loops = write_agent_loop_config(out_dir / "agent_loops.yaml", median_tokens=config.median_tokens,
                                    sigma=config.sigma, seed=config.seed)
    rollout = rollout_overrides(config, str(loops), vllm=vllm)

    def compose(overrides: list[str]) -> Any:
        return compose_trainer_config(tiny.policy, trainer=TRAINER, prompt_length=PROMPT_LENGTH,
                                      response_length=config.response_length, num_workers=1, overrides=overrides)

    configs = {"plugin": compose(verl_overrides(config, rm_path) + rollout)}
    if vllm:
        served = served_overrides(config, rm_path)
        replaced = {_key(o) for o in served}
        plugin_only = [o for o in verl_overrides(config, rm_path)
                       if _key(o) not in replaced and not _key(o).startswith("async_rm.")
                       and "agent_loop_manager_class" not in o]
        configs["served"] = compose(plugin_only + served + rollout)
        configs["plugin_vllm"] = compose([*verl_overrides(config, rm_path), *rollout, "+async_rm.engine=vllm"])
    return configs


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def _run_modes(config: DemoConfig, configs: dict[str, Any], tiny: Any,
               bar: Any) -> tuple[dict[str, list[StepTimeline]], dict[str, Any]]:
    import transfer_queue as tq

    tq.init(configs["plugin"].transfer_queue)
    try:
        return _run_with_transfer_queue(config, configs, tiny, bar)
    finally:
        tq.close()


def _run_with_transfer_queue(config: DemoConfig, configs: dict[str, Any], tiny: Any,
                             bar: Any) -> tuple[dict[str, list[StepTimeline]], dict[str, Any]]:
    """Start everything, run the steps; returns the modes' steps and how the cores were split (``cores``)."""
    import ray
    from transformers import AutoTokenizer

    from verl_async_rm.demo.modes import fit_loop, rule_scorer, run_async_step, run_served_step, run_sync_step
    from verl_async_rm.demo.workload import prompts_batch

    trainer_config = configs["plugin"]
    actors: list[Any] = []
    managers: list[Any] = []
    try:
        bar.set_description("start the rollout (vLLM)" if "served" in configs else "start the rollout (stand-in)")
        client, reset, generators = _start_rollout(config, trainer_config, tiny, actors, vllm="served" in configs)
        pin = _CorePinning(config.split_cores)
        pin("rollout", generators)
        bar.set_description("start RM replicas, agent loops")
        manager, plain, reward_loop_handles = _start_managers(trainer_config, client, actors, managers,
                                                              config.step_timeout_s)
        pin("rm", pids=_replica_pids(manager))
        async_loop, sync_loop = fit_loop(trainer_config, manager), fit_loop(trainer_config, plain)
        mix = manager.async_rm_config.mix  # parsed once, by the manager
        rule = rule_scorer(AutoTokenizer.from_pretrained(tiny.policy))
        replicas = manager.async_rm_config.rm.num_replicas
        steps: dict[str, Any] = {
            "async": lambda step, size, tag: run_async_step(
                async_loop, manager, prompts_batch(step, size, tag=tag, mode="async"), step, reset=reset),
        }
        if "plugin_vllm" in configs:
            bar.set_description("start the plugin's vLLM replicas")
            on_vllm, _ = _start_plugin_manager(configs["plugin_vllm"], client, actors, managers, reward_loop_handles)
            pin("rm", pids=_replica_pids(on_vllm))
            vllm_loop = fit_loop(configs["plugin_vllm"], on_vllm)
            steps["async_vllm"] = lambda step, size, tag: run_async_step(
                vllm_loop, on_vllm, prompts_batch(step, size, tag=tag, mode="asyncvllm"), step, reset=reset,
                mode="async_vllm")
        steps["sync"] = lambda step, size, tag: run_sync_step(
            sync_loop, manager.rm_service, replicas,  # the same replicas
            prompts_batch(step, size, tag=tag, mode="sync"), step,
            rule_score=rule, mix=mix, timeout_s=config.step_timeout_s, reset=reset)
        if "served" in configs:
            bar.set_description("start verl's served RM (vLLM)")
            served_rm, served = _start_served(configs["served"], client, actors, config.step_timeout_s)
            pin("rm", [h for r in served_rm.reward_model_manager.rollout_replicas for h in r.servers])
            served_loop = fit_loop(configs["served"], served)
            steps["verl_served"] = lambda step, size, tag: run_served_step(
                served_loop, served_rm.reward_loop_workers, replicas,
                prompts_batch(step, size, tag=tag, mode="served"), step, rule_score=rule, mix=mix, reset=reset)
        bar.update(1)
        return _run_steps(config, steps, bar), pin.info()
    finally:
        for started in managers:
            started.shutdown()
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


def _start_plugin_manager(trainer_config: Any, client: Any, actors: list[Any], managers: list[Any],
                          reward_loop_handles: Any = None) -> tuple[Any, Any]:
    """``(manager, reward_loop_handles)``: the plugin's v1 manager, after verl's ``RewardLoopManager`` as verl's
    trainer builds it; what it starts is appended to ``actors`` / ``managers``. ``reward_loop_handles``: another
    plugin manager's reward-loop workers (verl names them ``reward_loop_worker_{i}``, once per namespace; they run the
    rule only, the same for both)."""
    from verl.experimental.reward_loop import RewardLoopManager

    from verl_async_rm import AsyncRMAgentLoopManager

    if reward_loop_handles is None:
        reward_loop = RewardLoopManager(config=trainer_config, rm_resource_pool=None)
        actors += reward_loop.reward_loop_workers
        reward_loop_handles = reward_loop.reward_loop_worker_handles
    manager = AsyncRMAgentLoopManager.create(
        config=trainer_config, llm_client=client, teacher_client=None, reward_loop_worker_handles=reward_loop_handles,
    )
    managers.append(manager)
    actors += manager.agent_loop_workers
    return manager, reward_loop_handles


def _replica_pids(manager: Any) -> list[int]:
    import ray

    return [int(r["pid"]) for r in ray.get(manager.rm_service.describe.remote(), timeout=60) if "pid" in r]


def _start_managers(trainer_config: Any, client: Any, actors: list[Any], managers: list[Any],
                    timeout_s: float) -> tuple[Any, Any, Any]:
    """``(manager, plain, reward_loop_handles)``: the plugin's v1 manager (:func:`_start_plugin_manager`) and verl's
    plain ``AgentLoopManagerTQ`` with no reward-loop workers (verl's v1 trainer then scores after sampling,
    ``_compute_reward_colocate``). What they start is appended to ``actors`` / ``managers`` as it is started."""
    import ray
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ

    manager, reward_loop_handles = _start_plugin_manager(trainer_config, client, actors, managers)
    plain = AgentLoopManagerTQ.create(config=trainer_config, llm_client=client, teacher_client=None,
                                      reward_loop_worker_handles=None)
    actors += plain.agent_loop_workers
    ray.get([w.__ray_ready__.remote() for w in plain.agent_loop_workers], timeout=timeout_s)
    return manager, plain, reward_loop_handles


def _start_rollout(config: DemoConfig, trainer_config: Any, tiny: Any, actors: list[Any], *,
                   vllm: bool) -> tuple[Any, Any]:
    """``(llm_client, reset, servers)``: verl's ``vLLMReplica`` on vLLM, else the stand-in server (``reset`` forgets
    its repeat counts, so every mode gets the same tokens); ``servers`` are the actors that generate."""
    import ray

    if vllm:
        from verl_async_rm.testing.vllm_rollout import rollout_actors, start_vllm_rollout

        replica, client = start_vllm_rollout(trainer_config)
        actors += rollout_actors(replica)
        return client, None, list(replica.servers)
    from verl_async_rm.demo.workload import server_kwargs
    from verl_async_rm.testing import make_llm_client, start_generation_servers

    servers = start_generation_servers(1, name_prefix="demo_gen", **server_kwargs(config, str(tiny.policy)))
    actors += servers.values()
    server = next(iter(servers.values()))
    return make_llm_client(trainer_config, servers), lambda: ray.get(server.reset.remote(), timeout=60), [server]


def _start_served(served_config: Any, client: Any, actors: list[Any], timeout_s: float) -> tuple[Any, Any]:
    """verl's served RM (its pool, vLLM engines, timed reward-loop workers) and verl's plain manager in front."""
    import ray
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ

    from verl_async_rm.demo.served_rm import start_served_rm

    served_rm = start_served_rm(served_config)
    actors += served_rm.reward_loop_workers
    manager = AgentLoopManagerTQ.create(config=served_config, llm_client=client, teacher_client=None,
                                        reward_loop_worker_handles=served_rm.reward_loop_worker_handles)
    actors += manager.agent_loop_workers
    ray.get([w.__ray_ready__.remote() for w in manager.agent_loop_workers], timeout=timeout_s)
    return served_rm, manager


class _CorePinning:
    """The demo's core split (:mod:`verl_async_rm.demo.cores`): pins the rollout's and the RM's processes as they
    start; ``info()`` says what was done, for ``summary.json``."""

    def __init__(self, enabled: bool) -> None:
        from verl_async_rm.demo.cores import core_split

        self.split = core_split() if enabled else None
        self.pinned = {"rollout": 0, "rm": 0}
        if enabled and self.split is None:
            logger.warning("fewer than two cores (or no CPU affinity here): the rollout and the RM share the cores")

    def __call__(self, role: str, handles: Sequence[Any] = (), pids: Sequence[int] = ()) -> None:
        from verl_async_rm.demo.cores import actor_pid, pin_processes

        if self.split is None:
            return
        cores = self.split[0] if role == "rollout" else self.split[1]
        self.pinned[role] += pin_processes([*pids, *(actor_pid(h) for h in handles)], cores)

    def info(self) -> dict[str, Any] | None:
        if self.split is None:
            return None
        return {"rollout": sorted(self.split[0]), "rm": sorted(self.split[1]), "threads_pinned": dict(self.pinned)}


def _run_steps(config: DemoConfig, steps: dict[str, Any], bar: Any) -> dict[str, list[StepTimeline]]:
    """One untimed warm-up step per mode, then each step once per mode (in ``steps``' order), on the same prompts."""
    bar.set_description("warm-up")
    for run in steps.values():
        run(0, _WARMUP_SIZE, "warmup")
    modes: dict[str, list[StepTimeline]] = {name: [] for name in steps}
    for step in range(1, config.steps + 1):
        for name, run in steps.items():
            bar.set_description(f"step {step}/{config.steps} {name}")
            modes[name].append(run(step, config.batch_size, "step"))
            bar.update(1)
    return modes


def summary_config(config: DemoConfig, *, rollout: str = "standin", rollout_note: str | None = None) -> dict[str, Any]:
    """The ``config`` section of ``summary.json``: the demo's settings, the verl trainer, who generated (``vllm``:
    verl's vLLM replicas; ``standin``: the CPU stand-in server, with the reason) and the polling period."""
    from verl_async_rm.demo.modes import POLL_INTERVAL_S

    return {**config.to_dict(), "trainer": TRAINER, "rollout": rollout, "rollout_note": rollout_note,
            "replay_buffer_poll_interval_s": POLL_INTERVAL_S}


def _write(config: DemoConfig, out_dir: Path, modes: dict[str, list[StepTimeline]], wall_s: float,
           ray_info: dict[str, Any], *, rollout: str, rollout_note: str | None, cores: dict[str, Any]) -> DemoResult:
    from verl_async_rm.demo.plot import plot_timeline
    from verl_async_rm.demo.summary import build_summary, environment, write_summary

    timeline_path = out_dir / "timeline.png"
    summary_path = out_dir / "summary.json"
    plot_timeline(modes, timeline_path)
    summary = build_summary(
        modes, config={**summary_config(config, rollout=rollout, rollout_note=rollout_note), "cores": cores},
        env=environment(),
        wall_s=wall_s,
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
