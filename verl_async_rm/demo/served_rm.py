"""verl's own vLLM-served RM built standalone, as verl's v1 trainer builds it, with request timings: for the real-vLLM
tests (``tests/integration/test_real_vllm.py``), which compare the plugin's scores with verl's served RM's on the same
trajectories. (The demo runs verl's served RM inside verl's own trainer: :mod:`verl_async_rm.demo.served_reward`.)

verl's v1 trainer, with ``reward.reward_model.enable=True`` and ``enable_resource_pool=True``, creates a
``reward_pool`` of ``n_gpus_per_node x nnodes`` devices (``PPOTrainer`` in ``verl.trainer.ppo.v1.trainer_base``),
builds ``RewardLoopManager(config, rm_resource_pool=pool)`` (one vLLM pooling engine per device behind verl's router)
and hands its reward-loop workers to the agent-loop manager, whose workers score each trajectory as its agent loop
ends (``RewardLoopWorker.compute_score`` -> ``compute_score_disrm``: one ``/classify`` request).

verl's router is started from a fresh interpreter (:func:`router_spawned`), and :func:`start_served_rm` returns once
it accepts connections, or removes the reward pool it made (a pool left behind holds its devices from the next user).

Two additions, both in :class:`TimedRewardLoopWorker` (verl's ``RewardLoopWorker``):

- a clock: it records when each ``compute_score_disrm`` call started and ended (vLLM batches the requests inside its
  engine, out of the client's sight);
- verl 0.9.1's one missing key: ``RewardLoopWorker.compute_score_disrm`` returns ``{"reward_score": ...}`` alone,
  while ``AgentLoopWorker._compute_score`` reads ``result["reward_extra_info"]``, so verl's served RM on its own pool
  fails every trajectory with ``KeyError: 'reward_extra_info'`` (verl issue 7368; the one-line fix proposed upstream,
  pull request 7608, returns an empty ``reward_extra_info``, and so does this subclass). A verl 0.9.1 user needs the
  same fix, or a custom reward function that calls the RM itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import time
from collections.abc import Iterator
from typing import Any

from verl.experimental.reward_loop import RewardLoopManager
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

__all__ = ["TimedRewardLoopManager", "TimedRewardLoopWorker", "router_spawned", "start_served_rm", "stop_served_rm"]

#: How long :func:`start_served_rm` waits for verl's router to accept connections once started.
ROUTER_START_S = 120.0


class TimedRewardLoopWorker(RewardLoopWorker):
    """verl's ``RewardLoopWorker``, recording ``(start, end)`` (``time.time()``) of each served-RM request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: list[tuple[float, float]] = []

    async def compute_score_disrm(self, data: Any) -> dict:
        start = time.time()
        try:
            result = await super().compute_score_disrm(data)
        finally:
            self._calls.append((start, time.time()))
        return {"reward_extra_info": {}, **result}  # verl issue 7368 (see the module doc)

    def pop_calls(self) -> list[tuple[float, float]]:
        """The requests recorded since the previous call."""
        calls, self._calls = self._calls, []
        return calls


class TimedRewardLoopManager(RewardLoopManager):
    """verl's ``RewardLoopManager`` whose reward-loop workers are :class:`TimedRewardLoopWorker`.

    verl names its workers ``reward_loop_worker_{i}`` (``RewardLoopManager._init_reward_loop_workers``); a plugin
    manager's ``RewardLoopManager`` may already run under those names in the same Ray namespace, so these are named
    ``served_reward_loop_worker_{i}``, placed as verl places them (round-robin over the nodes, soft affinity).
    """

    #: The ``reward_pool`` its served RM's engines run in (set by :func:`start_served_rm`, removed by
    #: :func:`stop_served_rm`).
    reward_pool: Any = None

    def _init_reward_loop_workers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        worker_cls = ray.remote(TimedRewardLoopWorker)
        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0]
        self.reward_loop_workers = [
            worker_cls.options(
                name=f"served_reward_loop_worker_{i}",
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nodes[i % len(nodes)], soft=True),
            ).remote(self.config, self.reward_router_address)
            for i in range(self.config.reward.num_workers)
        ]


@contextlib.contextmanager
def router_spawned() -> Iterator[None]:
    """Within it, ``multiprocessing.Process`` spawns instead of forking. verl starts its router with
    ``verl.experimental.reward_loop.router.naive_router.launch_router_process``: a ``multiprocessing.Process`` of the
    default start method, a fork on Linux. A fork of a process that holds a Ray driver and its threads can abort in the
    child (seen here: "double free or corruption" a second after the fork, then verl's ``assert
    router_process.is_alive()`` failing); a spawned router starts from a fresh interpreter."""
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)


def wait_for_router(address: str, timeout_s: float = ROUTER_START_S) -> None:
    """Wait until verl's router at ``host:port`` (``[host]:port`` for IPv6) accepts a connection; ``TimeoutError``
    naming it after ``timeout_s``."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"verl's reward router at {address} did not accept connections within "
                                   f"{timeout_s:g}s ({err})") from None
            time.sleep(0.2)


def start_served_rm(config: Any) -> TimedRewardLoopManager:
    """verl's served RM on a ``reward_pool`` of its own, as verl's v1 trainer creates both (see module doc)."""
    from verl.single_controller.ray.base import ResourcePoolManager

    from verl_async_rm.testing.vllm_rollout import remove_pool

    rm = config.reward.reward_model
    pools = ResourcePoolManager(resource_pool_spec={"reward_pool": [rm.n_gpus_per_node] * rm.nnodes}, mapping={})
    pools.create_resource_pool()
    pool = pools.resource_pool_dict["reward_pool"]
    manager = None
    try:
        with router_spawned():
            manager = TimedRewardLoopManager(config=config, rm_resource_pool=pool)
        manager.reward_pool = pool
        wait_for_router(manager.reward_router_address)
    except BaseException:
        if manager is None:
            remove_pool(pool)  # its engines with it
        else:
            stop_served_rm(manager)
        raise
    return manager


def stop_served_rm(manager: TimedRewardLoopManager) -> None:
    """Kill its reward-loop workers and remove its reward pool (and so the served RM's engines in it)."""
    import ray

    from verl_async_rm.testing.vllm_rollout import remove_pool

    for worker in manager.reward_loop_workers:
        ray.kill(worker)
    remove_pool(manager.reward_pool)
