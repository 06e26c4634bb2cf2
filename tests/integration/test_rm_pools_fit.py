"""Pools that do not fit in the cluster (the main RM's plus those of ``async_rm.models.*``): a ``ValueError`` that
names each pool's keys and size and what the cluster has, and nothing left behind.

- too large in total: the manager fails before any service starts (nothing reserved, nothing loaded);
- enough in total but not node by node (an RM asks two nodes of a one-node cluster): the services start together,
  the one that cannot be placed fails, and every service started with it is stopped and its pool removed, and the
  agent-loop workers the manager started while the RMs loaded.

Run on the tests' local Ray cluster (8 CPUs, one node) while no other manager holds it.
"""

from __future__ import annotations

import time

import pytest
import ray
from manager_cases import TWO_REPLICAS, running_manager

pytestmark = pytest.mark.integration


def _pool_groups() -> set:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def test_pools_that_do_not_fit_in_total_fail_before_anything_starts(ray_local, tiny_models):
    before = _pool_groups()
    big = [TWO_REPLICAS, f"+async_rm.models.big.model_path={tiny_models.rm_alt}",
           "+async_rm.models.big.n_gpus_per_node=64"]
    with pytest.raises(ValueError) as info:
        with running_manager(ray_local, tiny_models, "v1", *big):
            pass
    message = str(info.value)
    assert message.startswith("the RM pools do not fit in the cluster: ")
    assert ("RM 'main': reward.reward_model.n_gpus_per_node=2 x reward.reward_model.nnodes=1 (2 CPU bundles); "
            "RM 'big': async_rm.models.big.n_gpus_per_node=64 x async_rm.models.big.nnodes=1 (64 CPU bundles); "
            "together they need 66 CPU, and the cluster has ") in message
    assert "free (8 CPU in all). Fix: make a pool smaller" in message
    assert _pool_groups() == before


def test_pools_that_do_not_fit_node_by_node_fail_at_placement_and_leave_nothing(ray_local, tiny_models):
    """Through the manager: the RMs load while verl's agent-loop workers start, so those are stopped too."""

    def ours() -> set:  # the RM replicas (named after their service) and verl's agent-loop workers
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(("verl_async_rm_", "agent_loop_worker_"))}

    wide = [f"+async_rm.models.wide.model_path={tiny_models.rm_alt}", "+async_rm.models.wide.nnodes=2"]
    before, groups = ours(), _pool_groups()
    with pytest.raises(ValueError, match=r"the RM pools could not be reserved: RM 'main': .*; RM 'wide': "
                                         r"async_rm\.models\.wide\.n_gpus_per_node=1 x async_rm\.models\.wide\."
                                         r"nnodes=2 \(2 CPU bundles\)\. The first failure \(while starting RM 'wide' "
                                         r"\(async_rm\.models\.wide\)\): the reward pool needs 2 node\(s\)"):
        with running_manager(ray_local, tiny_models, "v1", *wide):
            pass
    assert _pool_groups() == groups
    deadline = time.monotonic() + 60  # ray.kill only asks: wait (bounded) until Ray reports them gone
    while ours() - before:
        assert time.monotonic() < deadline, f"still alive: {sorted(ours() - before)}"
        time.sleep(0.2)
