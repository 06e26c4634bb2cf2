"""The policy's pool as the RM's (``reward.reward_model.enable_resource_pool=False``): verl hands the manager no pool,
so the placement groups of verl's ``global_pool`` are found by the names verl gives them
(``{prefix}verl_group_{'_'.join(process_on_nodes)}:{i}``, not an API: a change fails the start, naming them). A
replica takes ``1 / max_colocate_count`` of its bundle's GPU, as verl's colocated workers do, with the count verl
really gave the pool: its bundles' CPUs (verl's ``RayResourcePool`` asks ``{"CPU": max_colocate_count, "GPU": 1}``),
not ``ResourcePoolManager``'s class default, which a trainer may override per pool."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group_table
from verl.single_controller.ray.base import RayResourcePool, ResourcePoolManager, sort_placement_group_by_node_ip

from verl_async_rm.errors import ResourcePoolError
from verl_async_rm.scoring.rm_config import RMConfig

logger = logging.getLogger(__name__)

__all__ = ["PolicyPool", "policy_group_names", "POLICY_POOL_PREFIX"]

#: ``name_prefix`` of verl's actor/rollout pool (``init_resource_pool_mgr``'s ``global_pool_id``).
POLICY_POOL_PREFIX = "global_pool"


def policy_group_names(n_gpus_per_node: int, nnodes: int, prefix: str = POLICY_POOL_PREFIX) -> list[str]:
    """The names verl gives the policy pool's placement groups, one per node (module doc)."""
    store = "_".join(str(n_gpus_per_node) for _ in range(nnodes))
    return [f"{prefix}verl_group_{store}:{i}" for i in range(nnodes)]


class PolicyPool(RayResourcePool):
    """verl's actor/rollout pool, seen by the RM: its placement groups (found by name, within
    ``placement_timeout_s``), one replica per bundle."""

    def __init__(self, config: RMConfig, name_prefix: str = POLICY_POOL_PREFIX) -> None:
        super().__init__(process_on_nodes=[config.n_gpus_per_node] * config.nnodes, use_gpu=config.use_gpu,
                         name_prefix=name_prefix, max_colocate_count=ResourcePoolManager.max_colocate_count)
        self.replicas_per_node = config.n_gpus_per_node
        self.placement_timeout_s = config.placement_timeout_s

    def get_placement_groups(self, strategy: str = "STRICT_PACK", name: str | None = None,
                             device_name: str | None = None) -> list[PlacementGroup]:
        """verl's placement groups of the policy pool, ready, sorted as verl ranks them; ``ResourcePoolError`` if
        they are not there (verl's trainer reserves them before it builds the agent-loop manager)."""
        if self.pgs is not None:
            return self.pgs
        names = policy_group_names(self.store[0], len(self.store), self.name_prefix)
        deadline = time.monotonic() + self.placement_timeout_s
        groups = []
        for group_name in names:
            while True:
                try:
                    groups.append(get_placement_group(group_name))
                    break
                except ValueError:
                    if time.monotonic() >= deadline:
                        raise ResourcePoolError(
                            f"the policy pool's placement group {group_name!r} does not exist (looked for "
                            f"{', '.join(names)} for {self.placement_timeout_s:g}s). With "
                            "reward.reward_model.enable_resource_pool=False the RM goes in verl's actor/rollout pool, "
                            "which verl's trainer reserves (RayResourcePool 'global_pool') before it builds the "
                            "agent-loop manager. Fix: launch through verl's trainer with trainer.n_gpus_per_node / "
                            "nnodes as its pool, or give the RM its own pool "
                            "(reward.reward_model.enable_resource_pool=True)") from None
                    time.sleep(0.2)
        ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups),
                            timeout=max(1.0, deadline - time.monotonic()))
        if len(ready) < len(groups):
            raise ResourcePoolError(f"the policy pool's placement groups {names} were not ready within "
                                    f"{self.placement_timeout_s:g}s")
        self.pgs = sort_placement_group_by_node_ip(groups)
        cpus = placement_group_table(self.pgs[0])["bundles"][0].get("CPU")
        if cpus:  # what verl set on its pool (the count of processes a bundle holds)
            self.max_colocate_count = int(cpus)
        logger.info("RM replicas go in the policy pool's %d group(s) %s, %d processes a bundle", len(groups),
                    ", ".join(names), self.max_colocate_count)
        return self.pgs

    def replica_bundles(self) -> list[tuple[PlacementGroup, int]]:
        """``(placement group, bundle index)`` of each replica, in verl's rank order (one per GPU)."""
        if not self.pgs:
            raise ValueError("the policy pool's placement groups are not found yet: call get_placement_groups first")
        return [(pg, i) for pg in self.pgs for i in range(self.replicas_per_node)]

    def release(self) -> None:
        """Nothing: the placement groups are verl's, and outlive the RM."""
