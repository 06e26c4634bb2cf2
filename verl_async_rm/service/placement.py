"""The reward pool and the RM worker group on it. :class:`RMResourcePool` is verl's ``RayResourcePool`` with one
bundle per replica (``gpus_per_replica`` GPUs and CPUs, not verl's 10 CPUs per GPU), its node groups on distinct
nodes, reserved within ``placement_timeout_s`` (verl waits forever). Every replica comes from :func:`replica_group`."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

import ray
from ray.util.placement_group import (PlacementGroup, get_placement_group, placement_group, placement_group_table,
                                      remove_placement_group)
from verl.single_controller.ray.base import (RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, SubRayResourcePool,
                                             sort_placement_group_by_node_ip)
from verl.utils.device import get_device_name

from verl_async_rm.errors import ConfigValueError, ResourcePoolError, RewardModelError, remote_cause
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.policy_pool import PolicyPool
from verl_async_rm.service.replica import RMReplica

logger = logging.getLogger(__name__)

__all__ = ["RMResourcePool", "reserve_placement_groups", "create_rm_worker_group", "replica_group", "ReplicaFactory",
           "kill_quietly", "kill_and_wait", "shutdown_rm_worker_group", "remove_pool_groups", "replica_bundle"]

_NODE_ID_LABEL = "ray.io/node-id"
#: Keys of a replica's size checks before it loads: their ``ConfigValueError`` is raised as is (the fix is a setting).
_SIZE_KEYS = ("gpus_per_replica", "actor_rollout_ref.rollout.gpu_memory_utilization")


class RMResourcePool(RayResourcePool):
    """verl ``RayResourcePool`` for the RM: node-pinned placement groups reserved within ``placement_timeout_s``;
    ``use_gpu=False`` gives CPU-only bundles (tests, demo)."""

    def __init__(self, n_gpus_per_node: int, nnodes: int, *, gpus_per_replica: int = 1, use_gpu: bool = True,
                 placement_timeout_s: float = 300.0, name_prefix: str | None = None) -> None:
        super().__init__(process_on_nodes=[n_gpus_per_node // gpus_per_replica] * nnodes, use_gpu=use_gpu,
                         name_prefix=name_prefix, max_colocate_count=1)
        self.n_gpus_per_node, self.nnodes, self.gpus_per_replica = n_gpus_per_node, nnodes, gpus_per_replica
        self.replicas_per_node = n_gpus_per_node // gpus_per_replica
        self.placement_timeout_s = placement_timeout_s

    @classmethod
    def from_config(cls, config: RMConfig, name_prefix: str | None = None) -> RMResourcePool:
        return cls(config.n_gpus_per_node, config.nnodes, gpus_per_replica=config.gpus_per_replica,
                   use_gpu=config.use_gpu, placement_timeout_s=config.placement_timeout_s, name_prefix=name_prefix)

    def replica_bundles(self) -> list[tuple[PlacementGroup, int]]:
        """``(placement group, bundle index)`` of each replica, in the rank order of verl's ``RayWorkerGroup``
        (groups sorted by node IP, then bundle by bundle); the groups are reserved first."""
        return [(pg, i) for pg in sort_placement_group_by_node_ip(self.pgs) for i in range(self.replicas_per_node)]

    def get_placement_groups(self, strategy: str = "STRICT_PACK", name: str | None = None,
                             device_name: str | None = None) -> list[PlacementGroup]:
        """Reserve (once) one placement group per node, each pinned to its own node; raises ResourcePoolError."""
        if self.pgs is not None:
            return self.pgs
        bundle = replica_bundle(self.gpus_per_replica, self.use_gpu)
        nodes = _pick_nodes(bundle, self.replicas_per_node, self.nnodes, self.placement_timeout_s)
        prefix = name or f"{self.name_prefix}verl_async_rm_pool:"
        self.pgs = reserve_placement_groups(
            [[dict(bundle) for _ in range(self.replicas_per_node)] for _ in range(self.nnodes)], node_ids=nodes,
            strategy=strategy, name_prefix=prefix, timeout_s=self.placement_timeout_s)
        return self.pgs

    def release(self) -> None:
        """Free the placement groups (the replicas on them must be gone or going)."""
        for pg in self.pgs or []:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or the cluster is shutting down
                logger.debug("placement group %s already removed", pg.id, exc_info=True)
        self.pgs = None


def replica_bundle(gpus_per_replica: int, use_gpu: bool) -> dict[str, float]:
    """What one replica's bundle asks: ``gpus_per_replica`` CPUs, and as many accelerators unless CPU-only."""
    bundle = {"CPU": float(gpus_per_replica)}
    if use_gpu:
        from verl.plugin.platform import get_platform

        bundle[get_platform().ray_resource_name()] = float(gpus_per_replica)
    return bundle


def reserve_placement_groups(bundles_per_group: list[list[dict[str, float]]], *, node_ids: list[str] | None,
                             strategy: str, name_prefix: str, timeout_s: float) -> list[PlacementGroup]:
    """Create placement groups (group ``i`` pinned to ``node_ids[i]`` when given) and wait at most ``timeout_s``;
    ``ResourcePoolError`` (every group created here removed first) if they are not all placed in time."""
    pin = node_ids is not None and "bundle_label_selector" in inspect.signature(placement_group).parameters
    if node_ids is not None and not pin and len(bundles_per_group) > 1:
        logger.warning("this Ray (%s) cannot pin placement groups to nodes (no bundle_label_selector): the reward "
                       "pool's %d node groups may share a node", ray.__version__, len(bundles_per_group))
    pgs = []
    for i, bundles in enumerate(bundles_per_group):
        _remove_stale(f"{name_prefix}{i}")
        kwargs: dict[str, Any] = {}
        if pin:
            kwargs["bundle_label_selector"] = [{_NODE_ID_LABEL: node_ids[i]} for _ in bundles]
        pgs.append(placement_group(bundles=bundles, strategy=strategy, name=f"{name_prefix}{i}", **kwargs))
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise ResourcePoolError(
            f"the reward pool's placement groups were not placed within {timeout_s:g}s "
            f"({len(ready)} of {len(pgs)} ready). Asked: {_describe_ask(bundles_per_group)}"
            f"{' pinned to nodes ' + ', '.join(n[:8] for n in node_ids) if pin else ''}. "
            f"The cluster has: {_describe_cluster()}. Fix: free those resources (other placement groups, actors) "
            "or make the reward pool smaller (reward.reward_model.n_gpus_per_node / nnodes)")
    logger.info("reward pool reserved: %s", _describe_ask(bundles_per_group))
    return pgs


def create_rm_worker_group(config: RMConfig, pool: RMResourcePool | None = None,
                           name_prefix: str | None = None) -> RayWorkerGroup:
    """Reserve the pool, start one :class:`RMReplica` per bundle and load the RM on each: the verl
    ``RayWorkerGroup``. Raises ``ResourcePoolError``, ``ValueError`` (the RM does not fit) or ``RewardModelError``,
    everything released first."""
    if pool is None:
        pool = PolicyPool(config) if config.placement == "policy_pool" else RMResourcePool.from_config(
            config, name_prefix=name_prefix)
    pool.get_placement_groups()
    try:
        wg = replica_group(pool, config, name_prefix=name_prefix)
    except BaseException:
        pool.release()
        raise
    refs = [worker.init_model.remote(placement)
            for worker, placement in zip(wg.workers, pool.replica_bundles(), strict=True)]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=config.init_timeout_s)
    if pending:
        shutdown_rm_worker_group(wg)
        raise RewardModelError(
            f"{len(pending)} of {len(refs)} RM replicas did not load {config.model_path} within "
            f"{config.init_timeout_s:g}s. Fix: raise init_timeout_s for a large RM, or check the replicas' logs")
    infos = []
    for rank, ref in enumerate(refs):
        try:
            infos.append(ray.get(ref))
        except Exception as err:
            shutdown_rm_worker_group(wg)
            cause = remote_cause(err)
            if isinstance(cause, ConfigValueError) and cause.key in _SIZE_KEYS:  # too large for its GPUs: the fix
                raise cause from err
            raise RewardModelError(f"RM replica {rank} failed to load {config.model_path}: {cause}") from err
    logger.info("RM worker group ready: %d replica(s) of %s on nodes %s", len(infos), config.model_path,
                sorted({info["node_ip"] for info in infos}))
    return wg


def shutdown_rm_worker_group(wg: RayWorkerGroup) -> None:
    """Kill the replicas of ``wg`` and free its pool's placement groups (safe to call twice)."""
    for worker in wg.workers:
        kill_quietly(worker)
    wg.resource_pool.release()  # a no-op for the policy's pool, which is verl's


def replica_group(pool: RMResourcePool | PolicyPool, config: RMConfig, *, name_prefix: str | None,
                  index: int | None = None) -> RayWorkerGroup:
    """The one way a replica is spawned: a ``RayWorkerGroup`` of :class:`RMReplica` of every bundle, or of bundle
    ``index`` alone (a replacement). Creates the actors without waiting for them."""
    sub = None if index is None else SubRayResourcePool(
        placement_groups=sort_placement_group_by_node_ip(pool.pgs), start_bundle_index=index, subgroup_world_size=1,
        process_on_nodes=pool.store, use_gpu=pool.use_gpu, max_colocate_count=pool.max_colocate_count,
        name_prefix=name_prefix)
    replica = RayClassWithInitArgs(cls=ray.remote(RMReplica), config=config)
    if config.on_vllm and config.gpus_per_replica > 1:
        # the replica's actor holds its whole bundle: vLLM's tensor-parallel ranks are its processes, on those k
        # GPUs (CPUs), as verl's vLLMHttpServer runs a rollout replica over its workers' GPUs
        k = config.gpus_per_replica
        if pool.use_gpu:
            from verl.plugin.platform import get_platform

            # RayClassWithInitArgs.__call__ applies these after its one-GPU default (when there are two or more)
            replica.set_additional_resource({**get_platform().ray_resource_options(k), "num_cpus": k})
        else:
            replica.update_options({"num_cpus": k})
    return RayWorkerGroup(resource_pool=sub or pool, name_prefix=name_prefix, ray_cls_with_init=replica,
                          device_name=get_device_name() if pool.use_gpu else "cpu")


class ReplicaFactory:
    """``async factory(old_replica, index) -> new replica`` (the batcher's ``replace_replica``): a new replica in the
    lost replica's own bundle of the rm_wg (it never competes with the policy for resources), loaded within
    ``init_timeout_s``; a sharded replica is replaced whole. Owned by its caller (the RM service actor)."""

    def __init__(self, config: RMConfig, worker_group: RayWorkerGroup) -> None:
        self.config = config
        self.pool = worker_group.resource_pool
        self.bundles = self.pool.replica_bundles()  # replica i's bundle, in the worker group's rank order
        self.name_prefix = f"{worker_group.name_prefix}replacement_{uuid.uuid4().hex[:6]}_"
        self.made = 0

    async def __call__(self, old: Any, index: int) -> Any:
        """Kill what is left of ``old``, start a replica in bundle ``index`` and wait until its RM is loaded."""
        kill_quietly(old)
        self.made += 1
        group = replica_group(self.pool, self.config, name_prefix=f"{self.name_prefix}{self.made}_", index=index)
        replica = group.workers[0]
        try:
            info = await asyncio.wait_for(asyncio.wrap_future(replica.init_model.remote(self.bundles[index]).future()),
                                          self.config.init_timeout_s)
        except BaseException as err:
            kill_quietly(replica)
            if isinstance(err, asyncio.TimeoutError):
                raise RewardModelError(
                    f"replacement RM replica {index} did not load {self.config.model_path} within "
                    f"init_timeout_s={self.config.init_timeout_s:g}s (its bundle may not be free yet)") from None
            raise
        logger.warning("RM replica %d replaced on node %s", index, info.get("node_ip"))
        return replica


def kill_quietly(actor: Any) -> None:
    """Kill an actor (a replica, an RM service) that may be gone already."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        logger.debug("actor already gone", exc_info=True)


def kill_and_wait(actors: Iterable[Any], timeout_s: float) -> None:
    """Kill actors and wait, at most ``timeout_s``, until Ray reports each dead (``ray.kill`` only asks)."""
    actors = list(actors)
    for actor in actors:
        kill_quietly(actor)
    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while (left := deadline - time.monotonic()) > 0:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=left)
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                continue
            time.sleep(0.05)
        else:
            logger.warning("actor %s still answers %.0f s after it was killed", actor, timeout_s)
            return


def remove_pool_groups(name_prefix: str, nnodes: int) -> None:
    """Remove the placement groups of a pool made with ``name_prefix`` whose owner died before releasing them."""
    for i in range(nnodes):
        _remove_stale(f"{name_prefix}verl_async_rm_pool:{i}")


def _remove_stale(name: str) -> None:
    """Remove a placement group of this name left by a dead predecessor: placement groups live as long as the job,
    not the actor that made them, and a restarted RM service reuses its pool's names."""
    try:
        stale = get_placement_group(name)
    except ValueError:  # none of that name: the usual case
        return
    logger.warning("removing placement group %s left by a previous RM service", name)
    remove_placement_group(stale)


def _pick_nodes(bundle: dict[str, float], per_node: int, nnodes: int, timeout_s: float) -> list[str] | None:
    """``nnodes`` distinct nodes for the pool's groups (None for one: nothing to keep apart). Nodes too small in all
    fail at once; among the others Ray's own scheduler picks those with room now: a probe group of one node-sized
    bundle per node (``STRICT_SPREAD``), placed within ``timeout_s``, read back and removed."""
    need = {key: amount * per_node for key, amount in bundle.items()}
    fits = [n for n in ray.nodes() if n.get("Alive")
            and all(n.get("Resources", {}).get(key, 0.0) + 1e-9 >= amount for key, amount in need.items())]
    fix = ("lower reward.reward_model.n_gpus_per_node / nnodes, or add nodes (for CPU runs: use_gpu=False)")
    if len(fits) < nnodes:
        raise ResourcePoolError(
            f"the reward pool needs {nnodes} node(s) with {_fmt(need)} free each, and {len(fits)} node(s) have it. The "
            f"cluster has: {_describe_cluster()}. Fix: {fix}")
    if nnodes == 1:
        return None
    probe = placement_group([need] * nnodes, strategy="STRICT_SPREAD")
    try:
        if not ray.wait([probe.ready()], timeout=timeout_s)[0]:
            raise ResourcePoolError(
                f"no {nnodes} distinct nodes had {_fmt(need)} free within {timeout_s:g}s. The cluster has: "
                f"{_describe_cluster()}. Fix: free those resources (other placement groups, actors), or {fix}")
        nodes = placement_group_table(probe)["bundles_to_node_id"]
        return [nodes[i] for i in range(nnodes)]
    finally:
        remove_placement_group(probe)


def _describe_cluster() -> str:
    shown = ("GPU", "NPU", "CPU")
    nodes = [f"node {n['NodeID'][:8]} ({n['NodeManagerAddress']}): "
             + ", ".join(f"{k} {v:g}" for k, v in n.get("Resources", {}).items() if k in shown)
             for n in ray.nodes() if n.get("Alive")]
    free = ray.available_resources()
    return "; ".join(nodes or ["no alive node"]) + f"; free now: {_fmt({k: v for k, v in free.items() if k in shown})}"


def _describe_ask(bundles_per_group: list[list[dict[str, float]]]) -> str:
    first = bundles_per_group[0]  # every group alike
    return f"{len(bundles_per_group)} node(s) x {len(first)} bundle(s) of {_fmt(first[0])}"


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"
