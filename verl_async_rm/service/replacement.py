"""``ReplicaFactory``: a stand-in RM replica for a lost one, started in the lost replica's own bundle.

A sharded replica (``gpus_per_replica > 1``) is replaced whole: the stand-in is a new rank 0, which starts new other
ranks in the bundle (the lost ranks were owned by the lost rank 0, so Ray ended them with it).

The executor calls it (as its ``replace_slot``) when a replica died under a batch. The new
:class:`~verl_async_rm.service.replica.RMReplica` gets the placement-group bundle the dead one held (so it never
competes with the policy for resources; it starts "when resources allow": as soon as Ray has freed the dead actor's
bundle, or re-placed the group after a node loss) and the environment verl gave the original rank
(``single_controller/ray/base.py:632-640``); then it loads the RM within ``init_timeout_s``. It is owned by the
process that calls it (the RM service actor), so it goes away with it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_async_rm.errors import RewardModelError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.replica import RMReplica

logger = logging.getLogger(__name__)

__all__ = ["ReplicaFactory"]


class ReplicaFactory:
    """``async factory(old_replica, index) -> new replica``, for a worker group made by ``create_rm_worker_group``.

    Picklable (placement groups and plain data).

    Args:
        config: the RM settings (the replica loads ``config.model_path``; ``init_timeout_s`` bounds the start).
        worker_group: the verl ``RayWorkerGroup`` of the replicas; its pool's placement groups give the bundles,
            in verl's rank order (group by group, bundle by bundle).
    """

    def __init__(self, config: RMConfig, worker_group: Any) -> None:
        pool = worker_group.resource_pool
        if not pool.pgs:
            raise ValueError("the worker group's resource pool has no placement groups: create the group first")
        self.config = config
        self.bundles = pool.replica_bundles()  # replica i's bundle, in the worker group's rank order
        self.use_gpu = bool(pool.use_gpu)
        self.env = {
            "WORLD_SIZE": str(len(self.bundles)),
            "WG_PREFIX": str(worker_group.name_prefix),
            "WG_BACKEND": "ray",
            "RAY_LOCAL_WORLD_SIZE": str(pool.store[0]),
            "MASTER_ADDR": str(getattr(worker_group, "_master_addr", "") or ""),
            "MASTER_PORT": str(getattr(worker_group, "_master_port", "") or ""),
        }
        self.name_prefix = f"{worker_group.name_prefix}async_rm_replica_{uuid.uuid4().hex[:6]}"
        self.made = 0

    async def __call__(self, old: Any, index: int) -> Any:
        """Kill what is left of ``old``, start a replica in bundle ``index`` and wait until its RM is loaded."""
        try:
            ray.kill(old, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, which is the usual case
            logger.debug("lost RM replica %d already gone", index, exc_info=True)
        pg, bundle = self.bundles[index]
        self.made += 1
        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            ),
            "runtime_env": {"env_vars": {**self.env, "RANK": str(index)}},
            "name": f"{self.name_prefix}_{index}_gen{self.made}",
            "max_restarts": 0,
        }
        if self.use_gpu:
            from verl.plugin.platform import get_platform

            options.update(get_platform().ray_resource_options(1))
        replica = ray.remote(RMReplica).options(**options).remote(self.config)
        try:
            info = await asyncio.wait_for(_await(replica.init_model.remote((pg, bundle))),
                                          self.config.init_timeout_s)
        except BaseException as err:
            ray.kill(replica, no_restart=True)
            if isinstance(err, asyncio.TimeoutError):
                raise RewardModelError(
                    f"replacement RM replica {index} did not load {self.config.model_path} within "
                    f"init_timeout_s={self.config.init_timeout_s:g}s (its bundle may not be free yet)"
                ) from None
            raise
        logger.warning("RM replica %d replaced on node %s", index, info.get("node_ip"))
        return replica


async def _await(ref: Any) -> Any:
    return await ref
