"""``reward.reward_model.enable_resource_pool=False``: the RM on the policy's GPUs. Where the replicas go (one per
GPU of the trainer's pool), what it refuses (each with the key and the fix), and the memory check before loading."""

from __future__ import annotations

import json

import pytest
from conftest import require_vllm

from verl_async_rm.config import AsyncRMConfig
from verl_async_rm.errors import ConfigValueError
from verl_async_rm.integration.checks import check_verl_config
from verl_async_rm.scoring.colocation import actor_resident_bytes, check_colocated_memory, rm_need_bytes
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.vllm_engine import unsupported as vllm_unsupported
from verl_async_rm.service.policy_pool import policy_group_names

pytestmark = pytest.mark.unit

GIB = 1024**3


def _config(tiny_models, **extra):
    from omegaconf import OmegaConf

    base = {
        "trainer": {"use_v1": True, "n_gpus_per_node": 8, "nnodes": 2, "device": "cuda",
                    "v1": {"trainer_mode": "sync"}},
        "actor_rollout_ref": {"model": {"path": str(tiny_models.policy)},
                              "rollout": {"gpu_memory_utilization": 0.5}},
        "reward": {"reward_model": {"enable": False, "enable_resource_pool": False, "n_gpus_per_node": 8,
                                    "nnodes": 2, "model_path": str(tiny_models.rm)},
                   "reward_manager": {"name": "async_rm", "source": "register"}},
    }
    config = OmegaConf.create(base)
    for key, value in extra.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def test_the_replicas_go_on_every_gpu_of_the_trainers_pool(tiny_models):
    settings = AsyncRMConfig.from_verl(_config(tiny_models))
    rm = settings.rm
    assert rm.placement == "policy_pool" and (rm.n_gpus_per_node, rm.nnodes, rm.num_replicas) == (8, 2, 16)
    assert rm.rollout_memory_utilization == 0.5 and rm.actor_resident_bytes > 0
    own = AsyncRMConfig.from_verl(_config(tiny_models, **{"reward.reward_model.enable_resource_pool": True,
                                                          "reward.reward_model.n_gpus_per_node": 2,
                                                          "reward.reward_model.nnodes": 1}))
    assert own.rm.placement == "own_pool" and own.rm.num_replicas == 2 and own.rm.rollout_memory_utilization is None
    assert policy_group_names(8, 2) == ["global_poolverl_group_8_8:0", "global_poolverl_group_8_8:1"]


def test_the_v0_trainer_takes_the_rm_on_the_policys_gpus(tiny_models):
    """The v0 manager sleeps and wakes the RM itself (verl's v0 fit loop has no phase hook)."""
    settings = check_verl_config(_config(tiny_models, **{"trainer.use_v1": False}))
    assert settings.rm.placement == "policy_pool"


@pytest.mark.parametrize("key, value, match", [
    ("trainer.v1.trainer_mode", "separate_async", "separate_async.*trainer_mode=sync or colocate_async"),
    ("async_rm.gpus_per_replica", 2, "gpus_per_replica=2.*set gpus_per_replica=1"),
    ("async_rm.engine", "vllm", "engine='vllm'.*policy's GPUs sleeps"),
])
def test_what_cannot_run_on_the_policys_gpus_is_refused_with_the_fix(tiny_models, key, value, match):
    with pytest.raises(ValueError, match=match):
        check_verl_config(_config(tiny_models, **{key: value}))


def test_more_rms_than_a_bundle_holds_are_refused(tiny_models):
    config = _config(tiny_models, **{"async_rm.models.a.model_path": str(tiny_models.rm),
                                     "async_rm.models.b.model_path": str(tiny_models.rm)})
    with pytest.raises(ValueError, match=r"3 RMs \(main, a, b\).*at most 2 RMs"):
        check_verl_config(config)


def test_an_rm_path_missing_here_is_a_warning_naming_the_key(tiny_models, caplog):
    """A multi-node run may keep the RM on the reward nodes only: not refused, but said at WARNING, not INFO."""
    config = _config(tiny_models, **{"reward.reward_model.model_path": "/nowhere/rm"})
    with caplog.at_level("INFO", logger="verl_async_rm.integration.checks"):
        check_verl_config(config)
    [record] = [r for r in caplog.records if "/nowhere/rm" in r.getMessage()]
    assert record.levelname == "WARNING" and "reward.reward_model.model_path" in record.getMessage()


def test_an_extra_rm_cannot_size_a_pool_of_its_own_there(tiny_models):
    config = _config(tiny_models, **{"async_rm.models.a.model_path": str(tiny_models.rm),
                                     "async_rm.models.a.n_gpus_per_node": 1})
    with pytest.raises(ValueError, match="async_rm.models.a.n_gpus_per_node=1.*remove"):
        AsyncRMConfig.from_verl(config)


def test_engine_vllm_and_a_generate_judge_are_refused(tiny_models):
    require_vllm()  # without vLLM both are refused earlier, for that reason
    rm = RMConfig(model_path=str(tiny_models.rm), retemplate="never", placement="policy_pool")
    assert "sleeps while the policy trains" in vllm_unsupported(rm)
    with pytest.raises(ConfigValueError, match="engine='vllm'.*sleeps while the policy trains"):
        RMConfig(model_path=str(tiny_models.rm), retemplate="never", placement="policy_pool", engine="vllm")
    with pytest.raises(ConfigValueError, match="judge_readout='generate'.*judge_readout=logits"):
        RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy),
                 placement="policy_pool", reward_kind="judge", judge_readout="generate")


def _checkpoint(tmp_path, name, params, hidden, dtype="bfloat16"):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden, "torch_dtype": dtype}))
    total = params * (2 if dtype == "bfloat16" else 4)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}}))
    return str(path)


def test_the_memory_check_names_the_values_that_fit(tmp_path):
    rm_path = _checkpoint(tmp_path, "rm8b", 8 * 10**9, 4096)
    rm = RMConfig(model_path=rm_path, retemplate="never", placement="policy_pool", rollout_memory_utilization=0.7,
                  actor_resident_bytes=10 * GIB, micro_batch_max_tokens=16384)
    weights, batch = rm_need_bytes(rm)
    assert weights == 16 * 10**9 and batch == 16384 * 4096 * 2 * 16
    device = 80 * GIB
    with pytest.raises(ConfigValueError) as err:
        check_colocated_memory(rm, device)  # 80 GiB x 0.3 - 10 GiB = 14 GiB < 14.9 + 2 GiB
    message = str(err.value)
    assert message.startswith("actor_rollout_ref.rollout.gpu_memory_utilization=0.7")
    assert "gpu_memory_utilization=0.66" in message and "enable_resource_pool=True" in message
    for fixed in (RMConfig(**{**rm.__dict__, "rollout_memory_utilization": 0.66}),):
        check_colocated_memory(fixed, device)  # the value it names fits
    check_colocated_memory(rm, 141 * GIB)  # an H200 has room


def test_the_memory_check_can_name_a_smaller_micro_batch(tmp_path):
    rm_path = _checkpoint(tmp_path, "rm1b", 10**9, 2048)
    rm = RMConfig(model_path=rm_path, retemplate="never", placement="policy_pool", rollout_memory_utilization=0.6,
                  actor_resident_bytes=0, micro_batch_max_tokens=65536)
    with pytest.raises(ConfigValueError, match=r"\+async_rm.micro_batch_max_tokens=(\d+)") as err:
        check_colocated_memory(rm, 8 * GIB)
    tokens = int(err.value.fix.split("micro_batch_max_tokens=")[1].split(";")[0])
    check_colocated_memory(RMConfig(**{**rm.__dict__, "micro_batch_max_tokens": tokens}), 8 * GIB)


def test_the_actors_resident_share_follows_the_offload_keys(tmp_path, tiny_models):
    from omegaconf import OmegaConf

    policy = _checkpoint(tmp_path, "policy7b", 7 * 10**9, 3584)
    config = OmegaConf.create({"trainer": {"n_gpus_per_node": 8, "nnodes": 1},
                               "actor_rollout_ref": {"model": {"path": policy}}})
    assert actor_resident_bytes(config) == int(12 * 7 * 10**9 / 8)  # fp32 params + Adam's two moments
    OmegaConf.update(config, "actor_rollout_ref.actor.fsdp_config.param_offload", True, force_add=True)
    assert actor_resident_bytes(config) == int(8 * 7 * 10**9 / 8)
    OmegaConf.update(config, "actor_rollout_ref.actor.fsdp_config.optimizer_offload", True, force_add=True)
    assert actor_resident_bytes(config) == 0
