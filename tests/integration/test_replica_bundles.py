"""The bundle an RM replica's actor holds, on the cluster with logical GPUs (no model is loaded): a vLLM replica of
``gpus_per_replica=2`` holds both GPUs of its bundle, for its tensor-parallel engine's ranks to run on; a transformers
replica's rank 0 holds one (its other ranks, actors of their own, hold the rest)."""

from __future__ import annotations

import pytest
import ray

from verl_async_rm.scoring.rm_config import RMConfig

pytestmark = pytest.mark.integration

TP = 2


@pytest.mark.parametrize(("engine", "held"), [("vllm", TP), ("transformers", 1)])
def test_a_vllm_replica_holds_its_whole_bundle_of_gpus(vllm_ray, tiny_models, engine, held):
    from verl_async_rm.service.placement import RMResourcePool, replica_group

    cfg = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), engine=engine,
                   gpus_per_replica=TP, n_gpus_per_node=TP, placement_timeout_s=60)
    pool = RMResourcePool.from_config(cfg, name_prefix=f"tp_bundle_{engine}_")
    pool.get_placement_groups()
    try:
        [replica] = replica_group(pool, cfg, name_prefix=f"tp_bundle_{engine}_").workers
        gpus = ray.get(replica.__ray_call__.remote(lambda self: ray.get_runtime_context().get_accelerator_ids()),
                       timeout=120)["GPU"]
        ray.kill(replica)
    finally:
        pool.release()
    assert len(gpus) == held
