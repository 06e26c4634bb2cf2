"""Settings that would give a wrong or meaningless reward with no error are refused (or warned of) when verl checks
its config, before Ray starts, with the key, the value and the fix: a process RM read as an outcome RM, a causal LM
given as an outcome RM, step rewards summed by a sum-only estimator, a Hub id where a local directory is needed, and
a dataset column named like a key the plugin writes.

Every config is verl's real ``ppo_trainer`` config composed with Hydra overrides; the RMs are the tiny offline
ones (the PRM is Qwen2.5-Math-PRM's recipe: token classification, two labels, ``<extra_0>``)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from verl_async_rm.integration.checks import check_verl_config
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def prm():
    from verl_async_rm.testing.families import build_family_models

    return build_family_models()["prm"]


def compose(policy, rm, *overrides: str, trainer: str = "v1"):
    return compose_trainer_config(policy, trainer=trainer, overrides=[
        "reward.reward_model.enable_resource_pool=True", "reward.reward_model.n_gpus_per_node=1",
        "reward.reward_model.nnodes=1", f"reward.reward_model.model_path={rm}", "reward.reward_manager.name=async_rm",
        *overrides])


# --- 1. a process RM read as an outcome RM --------------------------------------------------------------------------


def test_a_token_classification_prm_left_at_the_default_kind_is_refused(tiny_models, prm):
    with pytest.raises(ValueError) as err:
        check_verl_config(compose(tiny_models.policy, prm))
    message = str(err.value)
    assert message.startswith("async_rm.reward_kind='outcome': the RM at") and "is a process RM" in message
    assert "Qwen2ForTokenClassification" in message and "2 labels and the step token '<extra_0>'" in message
    assert "+async_rm.reward_kind=process +async_rm.step_separator=\"'<extra_0>'\" (quoted for Hydra)" in message


def test_the_same_prm_as_an_extra_rm_names_its_own_key(tiny_models, prm):
    with pytest.raises(ValueError, match=r"^async_rm\.models\.prm\.reward_kind='outcome': .* is a process RM"):
        check_verl_config(compose(tiny_models.policy, tiny_models.rm, f"+async_rm.models.prm.model_path={prm}"))


def test_a_prm_is_read_as_a_process_rm_or_as_an_outcome_rm_when_the_user_says_so(tiny_models, prm):
    check_verl_config(compose(tiny_models.policy, prm, "+async_rm.reward_kind=process",
                              "+async_rm.step_separator='<extra_0>'"))
    settings = check_verl_config(compose(tiny_models.policy, prm, "+async_rm.reward_kind=outcome"))
    assert settings.rm.kind_given and settings.rm.reward_kind == "outcome"


def test_a_custom_code_process_rm_is_refused_at_config_and_at_load(tiny_models, tmp_path):
    """Qwen2.5-Math-PRM-7B's config: its own ``Qwen2ForProcessRewardModel`` code, loaded as ``AutoModel``."""
    from verl_async_rm.errors import ConfigValueError
    from verl_async_rm.scoring.scorer import RewardModelScorer

    shutil.copytree(tiny_models.rm, tmp_path / "prm")
    config_file = tmp_path / "prm" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(architectures=["Qwen2ForProcessRewardModel"], auto_map={
        "AutoConfig": "configuration_qwen2_rm.Qwen2RMConfig", "AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"})
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"async_rm\.reward_kind='outcome'.*architectures=\['Qwen2ForProcessRewardModel'\]"):
        check_verl_config(compose(tiny_models.policy, tmp_path / "prm", "+async_rm.trust_remote_code=True"))
    with pytest.raises(ConfigValueError, match="is a process RM"):  # a replica refuses it too, before any weight
        RewardModelScorer(RMConfig(model_path=str(tmp_path / "prm"), policy_tokenizer_path=str(tiny_models.policy),
                                   use_gpu=False, trust_remote_code=True))


def test_an_outcome_rm_with_two_labels_and_no_step_token_is_not_a_process_rm(tiny_models, tmp_path):
    shutil.copytree(tiny_models.rm, tmp_path / "rm")
    config_file = tmp_path / "rm" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(num_labels=2, id2label={"0": "bad", "1": "good"}, label2id={"bad": 0, "good": 1})
    config_file.write_text(json.dumps(config))
    from verl_async_rm.scoring.checkpoint import check_rm_checkpoint, process_rm_signs

    assert process_rm_signs(config, str(tmp_path / "rm")) == ([], None)
    check_rm_checkpoint(str(tmp_path / "rm"), trust_remote_code=False)


# --- 2. a causal LM given as an outcome RM --------------------------------------------------------------------------


def test_a_causal_lm_as_the_rm_is_refused_with_the_judge_key_in_the_fix(tiny_models, tiny_judges):
    with pytest.raises(ValueError, match=r"a generation model with no trained reward head.*\+async_rm\.reward_kind=judge"):
        check_verl_config(compose(tiny_models.policy, tiny_judges.lm))


# --- 3. step rewards under an estimator that reads only their sum ---------------------------------------------------


@pytest.mark.parametrize("estimator, warned", [("grpo", True), ("rloo", True), ("reinforce_plus_plus", False),
                                               ("gae", False)])
def test_token_level_step_rewards_with_a_sum_only_estimator_are_warned_of(tiny_models, prm, caplog, estimator, warned):
    caplog.set_level(logging.WARNING, logger="verl_async_rm.integration.checks")
    check_verl_config(compose(tiny_models.policy, prm, "+async_rm.reward_kind=process",
                              "+async_rm.step_separator='<extra_0>'", "+async_rm.process_reduction=none",
                              f"algorithm.adv_estimator={estimator}"))
    warnings = [r.getMessage() for r in caplog.records if "process_reduction=none" in r.getMessage()]
    assert bool(warnings) is warned, warnings
    if warned:
        assert f"algorithm.adv_estimator={estimator}" in warnings[0] and "more steps earns more" in warnings[0]
        assert "process_reduction=min" in warnings[0]


def test_a_reduced_process_rm_under_grpo_is_not_warned_of(tiny_models, prm, caplog):
    caplog.set_level(logging.WARNING, logger="verl_async_rm.integration.checks")
    check_verl_config(compose(tiny_models.policy, prm, "+async_rm.reward_kind=process",
                              "+async_rm.step_separator='<extra_0>'", "algorithm.adv_estimator=grpo"))
    assert not [r for r in caplog.records if "process_reduction" in r.getMessage()]


# --- 4. a Hub id where the replicas need a local directory ----------------------------------------------------------


def test_a_hub_id_as_the_policy_path_is_refused_naming_the_policy_key(tiny_models):
    with pytest.raises(ValueError) as err:
        check_verl_config(compose("Qwen/Qwen2.5-0.5B-Instruct", tiny_models.rm))
    message = str(err.value)
    assert message.startswith("actor_rollout_ref.model.path='Qwen/Qwen2.5-0.5B-Instruct' is not a directory here and "
                              "reads as a Hugging Face Hub id")
    assert "+async_rm.policy_tokenizer_path=/shared/Qwen2.5-0.5B-Instruct" in message
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir" in message  # the Hub's current CLI
    # a local copy named by the plugin's key takes its place; verl may keep the Hub id
    check_verl_config(compose("Qwen/Qwen2.5-0.5B-Instruct", tiny_models.rm,
                              f"+async_rm.policy_tokenizer_path={tiny_models.policy}"))


def test_a_hub_id_as_the_rm_path_is_refused_before_the_replicas_load(tiny_models):
    with pytest.raises(ValueError, match=r"^reward\.reward_model\.model_path='Skywork/Skywork-Reward-V2-Llama-3\.1-8B' "
                                         r"is not a directory here and reads as a Hugging Face Hub id"):
        check_verl_config(compose(tiny_models.policy, "Skywork/Skywork-Reward-V2-Llama-3.1-8B"))


# --- 5. what gpus_per_replica says of logits judges -----------------------------------------------------------------


def test_gpus_per_replica_help_matches_what_logits_judges_accept(tiny_models, tiny_judges):
    """Logits judges shard like outcome RMs (tests/integration/test_sharded_replicas.py runs one on two ranks): the
    help must not say otherwise, and the config accepts it."""
    help_text = RMConfig.__dataclass_fields__["gpus_per_replica"].metadata["help"]
    assert "1 only" not in help_text and "logits judges included" in help_text
    config = RMConfig(model_path=str(tiny_judges.lm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      reward_kind="judge", judge_readout="logits", n_gpus_per_node=2, gpus_per_replica=2)
    assert config.num_replicas == 1


# --- 6. a dataset column named like a key the plugin writes ---------------------------------------------------------


def write_parquet(path, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "2+2?"}]], "data_source": ["d"], **columns}),
                   path)
    return path


@pytest.mark.parametrize("column, where", [("rm_score", "column"), ("rm_total", "column"),
                                           ("rm_score_main", "column")])
def test_a_dataset_column_named_like_a_reward_key_is_refused(tiny_models, tmp_path, column, where):
    data = write_parquet(tmp_path / "train.parquet", **{column: [1.0]})
    with pytest.raises(ValueError, match=rf"^data\.train_files: .*train\.parquet has {where}\(s\) \['{column}'\], "
                                         r"named like the key\(s\) the plugin writes into each trajectory's "
                                         r"reward_extra_info"):
        check_verl_config(compose(tiny_models.policy, tiny_models.rm, f"data.train_files={data}"))


def test_an_extra_info_field_named_like_the_rm_score_is_refused_at_start_and_per_trajectory(tiny_models, tmp_path):
    from verl_async_rm.reward_mix import with_rm_scores

    data = write_parquet(tmp_path / "val.parquet", extra_info=[{"index": 0, "rm_score": 0.5}])
    with pytest.raises(ValueError, match=r"^data\.val_files: .*extra_info field\(s\) \['rm_score'\]"):
        check_verl_config(compose(tiny_models.policy, tiny_models.rm, f"data.val_files=[{data}]"))
    with pytest.raises(ValueError, match=r"extra_info already holds \['rm_score'\]"):
        with_rm_scores({"index": 0, "rm_score": 0.5}, {"main": 1.0})


def test_rule_keys_are_ours_only_when_the_rule_counts_and_clean_datasets_pass(tiny_models, tmp_path):
    data = write_parquet(tmp_path / "train.parquet", rule_score=[0.0], extra_info=[{"index": 0}])
    check_verl_config(compose(tiny_models.policy, tiny_models.rm, f"data.train_files={data}"))  # no rule: no key
    with pytest.raises(ValueError, match=r"\['rule_score'\]"):
        check_verl_config(compose(tiny_models.policy, tiny_models.rm, f"data.train_files={data}",
                                  "+async_rm.rule_weight=1"))
