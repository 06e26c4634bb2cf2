"""The reward pool across nodes: a two-node ``ray.cluster_utils.Cluster`` on this machine.

Each node has room for both replicas, so only the pool's node pinning puts them on different nodes.
"""

from __future__ import annotations

from functools import partial

import pytest
import ray
from conftest import ray_runtime_env, stop_ray
from ray.cluster_utils import Cluster

from verl_async_rm.errors import ResourcePoolError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.actors import call_replica
from verl_async_rm.service.placement import create_rm_worker_group, RMResourcePool, shutdown_rm_worker_group

pytestmark = pytest.mark.integration


@pytest.fixture
def two_nodes():
    """A head and a worker node, 2 logical CPUs each; conftest's ``ray_local`` is shut down first."""
    stop_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    cluster.add_node(num_cpus=2, num_gpus=0)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=ray_runtime_env(), namespace="verl_async_rm_multinode")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.asyncio
async def test_replicas_land_on_both_nodes_and_score(two_nodes, tiny_models):
    from transformers import AutoTokenizer

    node_ids = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(node_ids) == 2
    cfg = RMConfig(
        model_path=str(tiny_models.rm),
        policy_tokenizer_path=str(tiny_models.policy),
        use_gpu=False,
        n_gpus_per_node=1,
        nnodes=2,
        placement_timeout_s=60,
    )
    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    messages = [{"role": "user", "content": "how many apples does the farmer have"}]
    prompt_ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
    requests = [
        RMRequest(f"t{i}", prompt_ids, tok(answer)["input_ids"] + [tok.eos_token_id], raw_prompt=messages)
        for i, answer in enumerate(["five", "the farmer has five apples", "three"])
    ]
    wg = create_rm_worker_group(cfg)
    try:
        infos = [await worker.describe.remote() for worker in wg.workers]
        assert {info["node_id"] for info in infos} == node_ids
        batch_fn = partial(call_replica, grace_s=60.0)
        first, second = [await batch_fn(requests, replica) for replica in wg.workers]
        assert all(isinstance(score, float) for score in first)
        assert second == pytest.approx(first, abs=1e-4, rel=1e-4)
        # Each node now has 1 of its 2 CPUs left: a second 2-node pool of 2 replicas per node cannot fit (Ray's
        # scheduler says so within the placement timeout; nothing is left reserved).
        with pytest.raises(ResourcePoolError, match=r"no 2 distinct nodes had \{CPU: 2\} free within 2s"):
            RMResourcePool(2, 2, use_gpu=False, placement_timeout_s=2).get_placement_groups()
    finally:
        shutdown_rm_worker_group(wg)
