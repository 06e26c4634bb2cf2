"""``gpus_per_replica``: its checks on verl's command line, the pool's shape, the memory check before load, the choice
of sharding method, and the sharded load path itself in one process (a group of one rank, gloo)."""

from __future__ import annotations

import json

import pytest
from rm_cases import ANSWERS, QUESTIONS, make_request

from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.sharding import check_replica_memory, sharding_method
from verl_async_rm.config import AsyncRMConfig
from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit

GB = 10**9


def compose(models, *overrides: str):
    base = ["reward.reward_model.enable_resource_pool=True", "reward.reward_model.n_gpus_per_node=4",
            "reward.reward_model.nnodes=1", f"reward.reward_model.model_path={models.rm}",
            "reward.reward_manager.name=async_rm"]
    return compose_trainer_config(models.policy, trainer="v1", overrides=base + list(overrides))


def test_the_pool_is_cut_into_replicas_of_k_gpus(tiny_models):
    rm = AsyncRMConfig.from_verl(compose(tiny_models, "+async_rm.gpus_per_replica=2")).rm
    assert (rm.gpus_per_replica, rm.replicas_per_node, rm.num_replicas) == (2, 2, 2)
    assert AsyncRMConfig.from_verl(compose(tiny_models)).rm.num_replicas == 4  # default: one GPU per replica


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", r"^async_rm\.gpus_per_replica=0: a replica needs at least one GPU\. Fix: set "
              r"async_rm\.gpus_per_replica=1"),
        ("-2", r"^async_rm\.gpus_per_replica=-2: a replica needs at least one GPU"),
        ("1.5", r"^async_rm\.gpus_per_replica=1\.5: a replica needs at least one GPU"),
        ("3", r"^async_rm\.gpus_per_replica=3: .*n_gpus_per_node=4 \(reward\.reward_model\.n_gpus_per_node.*not a "
              r"multiple of gpus_per_replica\. Fix: set n_gpus_per_node to a multiple of 3 \(e\.g\. 6\), or "
              r"async_rm\.gpus_per_replica to one of \[1, 2, 4\]"),
        ("8", r"^async_rm\.gpus_per_replica=8: a replica's GPUs are all on one node, and a node has "
              r"n_gpus_per_node=4 .*smaller than gpus_per_replica\. Fix: .*one of \[1, 2, 4\]"),
    ],
)
def test_bad_gpus_per_replica_names_both_keys_and_the_fix(tiny_models, value, message):
    with pytest.raises(ValueError, match=message):
        AsyncRMConfig.from_verl(compose(tiny_models, f"+async_rm.gpus_per_replica={value}"))


def test_an_extra_rm_has_its_own_gpus_per_replica_and_does_not_inherit_the_top_one(tiny_models):
    config = AsyncRMConfig.from_verl(compose(
        tiny_models, "+async_rm.gpus_per_replica=4", f"+async_rm.models.small.model_path={tiny_models.rm_alt}",
        f"+async_rm.models.big.model_path={tiny_models.rm_alt}", "+async_rm.models.big.n_gpus_per_node=2",
        "+async_rm.models.big.gpus_per_replica=2",
    ))
    shapes = {e.name: (e.rm.gpus_per_replica, e.rm.num_replicas) for e in config.models}
    assert shapes == {"main": (4, 1), "small": (1, 1), "big": (2, 1)}
    with pytest.raises(ValueError, match=r"^async_rm\.models\.big\.gpus_per_replica=2: .*n_gpus_per_node=1"):
        AsyncRMConfig.from_verl(compose(tiny_models, f"+async_rm.models.big.model_path={tiny_models.rm_alt}",
                                        "+async_rm.models.big.gpus_per_replica=2"))


def fake_checkpoint(tmp_path, total_size: int, dtype: str = "bfloat16"):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": {}}))
    return tmp_path


def rm(path, **kwargs) -> RMConfig:
    return RMConfig(model_path=str(path), retemplate="never", **kwargs)


def test_a_70b_rm_on_80gb_gpus_is_refused_with_the_size_and_the_gpus_per_replica_that_fits(tmp_path):
    path = fake_checkpoint(tmp_path, 141 * GB)  # Llama-3.1-70B-sized: 141 GB of bf16 weights
    with pytest.raises(ValueError, match=r"^gpus_per_replica=1: the RM's weights take 131\.3 GiB in bfloat16, 131\.3 "
                                         r"GiB on each of the replica's 1 GPU\(s\): more than 90% of a 74\.5 GiB GPU "
                                         r"of this pool\. Fix: set gpus_per_replica=2$"):
        check_replica_memory(rm(path, n_gpus_per_node=8), device_bytes=80 * GB)
    check_replica_memory(rm(path, n_gpus_per_node=8, gpus_per_replica=2), device_bytes=80 * GB)
    with pytest.raises(ValueError, match=r"Fix: set gpus_per_replica=4$"):  # the next k that divides the node
        check_replica_memory(rm(path, n_gpus_per_node=4), device_bytes=48 * GB)
    with pytest.raises(ValueError, match=r"needs 4 GPUs of this type per replica, all on one node, and the pool's "
                                         r"nodes have n_gpus_per_node=2"):
        check_replica_memory(rm(path, n_gpus_per_node=2, gpus_per_replica=2), device_bytes=48 * GB)


def test_the_memory_check_counts_the_dtype_the_rm_is_loaded_in(tmp_path):
    path = fake_checkpoint(tmp_path, 54 * GB)  # a 27B RM stored in bf16
    check_replica_memory(rm(path, n_gpus_per_node=2), device_bytes=80 * GB)
    with pytest.raises(ValueError, match=r"100\.6 GiB in float32.*Fix: set gpus_per_replica=2$"):
        check_replica_memory(rm(path, n_gpus_per_node=2, dtype="float32"), device_bytes=80 * GB)


def test_without_weight_files_there_is_nothing_to_check(tmp_path, tiny_models):
    check_replica_memory(rm(tmp_path, n_gpus_per_node=1), device_bytes=1)  # no weights found: no figure to give
    with pytest.raises(ValueError, match=r"^gpus_per_replica=1: the RM's weights take"):  # file sizes when no index
        check_replica_memory(rm(tiny_models.rm, n_gpus_per_node=2), device_bytes=1000)


def test_tensor_parallel_where_the_plan_and_the_sizes_allow_it_else_fsdp2():
    from transformers import GPT2Config, LlamaConfig

    llama = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64, hidden_size=32)
    assert sharding_method(llama, 2)[0] == "tensor_parallel"
    method, why = sharding_method(llama, 8)
    assert method == "fsdp2" and "'num_key_value_heads': 4" in why
    assert sharding_method(GPT2Config(), 2) == ("fsdp2", "GPT2Config has no tensor-parallel plan")


@pytest.mark.parametrize("layout", ["tensor_parallel", "fsdp2"])
def test_the_sharded_load_path_scores_as_the_unsharded_scorer(tiny_models, policy_tok, monkeypatch, layout):
    """One rank of gloo: the same code path a sharded replica runs (the group, the mesh, the sharded load)."""
    import verl_async_rm.scoring.sharding as sharding
    from verl_async_rm.scoring.scorer import RewardModelScorer

    if layout == "fsdp2":
        monkeypatch.setattr(sharding, "sharding_method", lambda config, k: ("fsdp2", "forced by the test"))
    config = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False)
    requests = [make_request(policy_tok, q, a, f"p{i}/0") for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS))]
    host, port, store = sharding.host_store(1, 60.0)
    try:
        sharded = RewardModelScorer(config, shard=sharding.ShardGroup(0, 1, host, port, 60.0), store=store)
        assert sharded.describe()["sharding"] == layout
        scores = sharded.score(requests)
    finally:
        sharding.leave_group()
    assert scores == pytest.approx(RewardModelScorer(config).score(requests), abs=1e-5)


def test_the_pools_text_of_a_start_failure_gives_the_replica_shape(tiny_models):
    from verl_async_rm.service.service import pools_text

    config = AsyncRMConfig.from_verl(compose(
        tiny_models, "+async_rm.gpus_per_replica=2", f"+async_rm.models.big.model_path={tiny_models.rm_alt}",
        "+async_rm.models.big.n_gpus_per_node=8", "+async_rm.models.big.gpus_per_replica=4",
    ))
    assert pools_text(config.models) == (
        "RM 'main': reward.reward_model.n_gpus_per_node=4 x reward.reward_model.nnodes=1 (4 CPUs: 2 replicas of "
        "async_rm.gpus_per_replica=2); RM 'big': async_rm.models.big.n_gpus_per_node=8 x "
        "async_rm.models.big.nnodes=1 (8 CPUs: 2 replicas of async_rm.models.big.gpus_per_replica=4)"
    )


def test_every_kind_and_engine_takes_k_gpus_and_the_memory_fix_is_a_value_the_config_accepts(tmp_path):
    """engine=vllm and judge_readout=generate run one tensor-parallel engine per replica, a logits judge is sharded
    as an outcome RM; the memory check's fix for a 72B judge is a gpus_per_replica the config then accepts."""
    assert rm(tmp_path, engine="vllm", gpus_per_replica=2, n_gpus_per_node=4).on_vllm

    def judge(path, **kwargs) -> RMConfig:
        return RMConfig(model_path=str(path), policy_tokenizer_path="policy", reward_kind="judge", n_gpus_per_node=8,
                        **kwargs)

    assert judge(tmp_path, judge_readout="generate", gpus_per_replica=4).num_replicas == 2
    assert judge(tmp_path, gpus_per_replica=4).num_replicas == 2  # logits: sharded on transformers
    path = fake_checkpoint(tmp_path, 145 * GB)  # a 72B judge
    for readout in ("logits", "generate"):
        with pytest.raises(ValueError, match=r"135\.0 GiB.*Fix: set gpus_per_replica=4$"):
            check_replica_memory(judge(path, judge_readout=readout), device_bytes=80 * GB)
        check_replica_memory(judge(path, judge_readout=readout, gpus_per_replica=4), device_bytes=80 * GB)


@pytest.mark.parametrize(("ranks", "asked", "cores", "bind"), [
    (2, None, {0, 1}, "0|1"), (2, "auto", {0, 1}, "0|1"),
    (2, "nobind", {0, 1, 2, 3}, "0,1|2,3"), (2, "0|3", {0, 1, 2, 3}, "0|3"), (2, None, {5}, "nobind")])
def test_each_cpu_rank_gets_its_own_share_of_the_cores(monkeypatch, ranks, asked, cores, bind):
    import os

    from verl_async_rm.scoring.vllm_engine import cpu_binding

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    assert cpu_binding(ranks, asked) == bind
