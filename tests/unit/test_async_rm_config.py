"""``AsyncRMConfig.from_verl`` splits ``async_rm.*`` into its sections; ``RewardMix``; ``check_verl_config``.

Every config here is verl's real ``ppo_trainer`` config, composed with Hydra overrides as on verl's command line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from verl_async_rm.config import AsyncRMConfig, IntegrationConfig
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.integration.checks import check_verl_config
from verl_async_rm.reward_mix import RewardMix
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit

ASSETS = Path(__file__).parent / "assets"


def valid_overrides(models) -> list[str]:
    """The smallest set of verl keys the plugin accepts."""
    return [
        "reward.reward_model.enable_resource_pool=True",
        "reward.reward_model.n_gpus_per_node=2",
        "reward.reward_model.nnodes=1",
        f"reward.reward_model.model_path={models.rm}",
        "reward.reward_manager.name=async_rm",
    ]


def compose(models, *overrides: str, trainer: str = "v1"):
    return compose_trainer_config(models.policy, trainer=trainer, overrides=valid_overrides(models) + list(overrides))


# --- AsyncRMConfig.from_verl ---------------------------------------------------------------------------------------


def test_defaults_with_no_async_rm_group(tiny_models):
    cfg = compose(tiny_models)
    assert "async_rm" not in cfg
    settings = AsyncRMConfig.from_verl(cfg)
    assert settings.batching == BatchPolicy(batch_timeout_s=600.0)  # the plugin bounds a batch call by default
    assert settings.mix == RewardMix()
    assert settings.integration == IntegrationConfig()
    assert settings.rm.model_path == str(tiny_models.rm)
    assert settings.rm.policy_tokenizer_path == str(tiny_models.policy)
    assert (settings.rm.n_gpus_per_node, settings.rm.nnodes, settings.rm.num_replicas) == (2, 1, 2)
    assert settings.rm.use_gpu is False  # trainer.device=cpu
    assert settings.rm.dtype == RMConfig.__dataclass_fields__["dtype"].default


def test_each_section_receives_its_keys_and_only_those(tiny_models):
    cfg = compose(
        tiny_models,
        "+async_rm.max_batch_size=8",
        "+async_rm.max_wait_ms=5",
        "+async_rm.replica_retries=3",
        "+async_rm.dtype=float32",
        "+async_rm.micro_batch_max_tokens=1024",
        "+async_rm.trust_remote_code=True",
        "+async_rm.rm_weight=0.5",
        "+async_rm.rule_weight=2",
        "+async_rm.combine_fn=pkg.mod:fn",
        "+async_rm.request_timeout_s=30",
        "+async_rm.service_max_concurrency=64",
    )
    settings = AsyncRMConfig.from_verl(cfg)
    # a batch call is bounded by default (600 s)
    assert settings.batching == BatchPolicy(max_batch_size=8, max_wait_ms=5.0, replica_retries=3, batch_timeout_s=600)
    assert (settings.rm.dtype, settings.rm.micro_batch_max_tokens, settings.rm.trust_remote_code) == (
        "float32", 1024, True
    )
    assert settings.mix == RewardMix(rm_weight=0.5, rule_weight=2, combine_fn="pkg.mod:fn")
    assert settings.integration == IntegrationConfig(request_timeout_s=30, service_max_concurrency=64)


def test_nested_mappings_work_like_a_dictconfig(tiny_models):
    from omegaconf import OmegaConf

    cfg = compose(tiny_models, "+async_rm.max_batch_size=4", "+async_rm.rule_weight=1.5")
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert AsyncRMConfig.from_verl(plain) == AsyncRMConfig.from_verl(cfg)


def test_unknown_key_lists_every_known_key(tiny_models):
    with pytest.raises(ValueError, match=r"unknown key async_rm\.max_batch=8") as info:
        AsyncRMConfig.from_verl(compose(tiny_models, "+async_rm.max_batch=8"))
    listed = set(str(info.value).split("known keys: ")[1].split(", "))
    kinds = (BatchPolicy, RMConfig, RewardMix, IntegrationConfig)
    fields = {f.name for kind in kinds for f in dataclasses.fields(kind) if not f.metadata.get("internal")}
    assert listed == fields - {"model_path", "n_gpus_per_node", "nnodes", "use_gpu"} | {"models"}


#: Fields the plugin fills itself (``metadata={"internal": True}``): never a user's key.
INTERNAL_RM_FIELDS = sorted(f.name for f in dataclasses.fields(RMConfig) if f.metadata.get("internal"))


@pytest.mark.parametrize("field_name", INTERNAL_RM_FIELDS)
@pytest.mark.parametrize("where", ["async_rm", "async_rm.models.safety"])
def test_an_internal_field_is_not_a_users_key_nor_listed(tiny_models, field_name, where):
    """``+async_rm.models.safety.placement=policy_pool`` once passed the checks: internal fields are refused like a
    misspelt key, at the top and per RM, and the known keys the error lists hold none of them."""
    extra = ["+async_rm.models.safety.model_path=/m"] if where != "async_rm" else []
    with pytest.raises(ValueError, match=rf"unknown key {re.escape(where)}\.{field_name}=") as info:
        AsyncRMConfig.from_verl(compose(tiny_models, *extra, f"+{where}.{field_name}=1"))
    listed = set(str(info.value).split("known keys: ")[1].split(", "))
    assert listed and not listed & set(INTERNAL_RM_FIELDS)


@pytest.mark.parametrize(
    ("key", "suggested"),
    [("async_rm.max_batch=8", "async_rm.max_batch_size"), ("async_rm.rm_wieght=2", "async_rm.rm_weight"),
     ("async_rm.models.safety.max_lenght=5", "async_rm.models.safety.max_length")],
)
def test_a_misspelt_key_gets_the_closest_known_one(tiny_models, key, suggested):
    with pytest.raises(ValueError, match=rf"\(did you mean {re.escape(suggested)}\?\); known keys: "):
        AsyncRMConfig.from_verl(compose(tiny_models, "+async_rm.models.safety.model_path=/m", f"+{key}"))


def test_a_key_far_from_every_known_one_gets_no_suggestion(tiny_models):
    with pytest.raises(ValueError, match=r"unknown key async_rm\.zzzzqqq=1; known keys: ") as info:
        AsyncRMConfig.from_verl(compose(tiny_models, "+async_rm.zzzzqqq=1"))
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize(
    ("key", "value", "use_instead"),
    [
        ("model_path", "/models/rm", "reward.reward_model.model_path"),
        ("n_gpus_per_node", "4", "reward.reward_model.n_gpus_per_node"),
        ("nnodes", "2", "reward.reward_model.nnodes"),
        ("use_gpu", "False", "trainer.device"),
    ],
)
def test_verl_owned_rm_keys_are_refused_with_the_verl_key(tiny_models, key, value, use_instead):
    with pytest.raises(ValueError, match=rf"async_rm\.{key}=.* is not read: .*set {use_instead} instead"):
        AsyncRMConfig.from_verl(compose(tiny_models, f"+async_rm.{key}={value}"))


@pytest.mark.parametrize(
    ("overrides", "key", "error"),
    [
        # batching -> BatchPolicy
        (["+async_rm.max_batch_size=0"], "max_batch_size", ValueError),
        (["+async_rm.max_batch_size=abc"], "max_batch_size", TypeError),
        (["+async_rm.max_wait_ms=-1"], "max_wait_ms", ValueError),
        (["+async_rm.replica_retries=-1"], "replica_retries", ValueError),
        (["+async_rm.group_by_length=maybe"], "group_by_length", TypeError),
        (["+async_rm.batch_timeout_s=0"], "batch_timeout_s", ValueError),
        # RM worker group -> RMConfig
        (["+async_rm.dtype=fp8"], "dtype", ValueError),
        (["+async_rm.micro_batch_max_tokens=0"], "micro_batch_max_tokens", ValueError),
        (["+async_rm.score_reduction=median"], "score_reduction", ValueError),
        # reward mix -> RewardMix
        (["+async_rm.rm_weight=nan"], "rm_weight", ValueError),
        (["+async_rm.rule_weight=abc"], "rule_weight", ValueError),
        (["+async_rm.combine_fn=no_colon"], "combine_fn", ValueError),
        # the rest -> IntegrationConfig
        (["+async_rm.request_timeout_s=0"], "request_timeout_s", ValueError),
        (["+async_rm.on_error=skip"], "on_error", ValueError),
            (["+async_rm.drop_budget=1.5"], "drop_budget", ValueError),
        (["+async_rm.service_max_concurrency=8"], "service_max_concurrency", ValueError),
    ],
)
def test_bad_values_name_the_async_rm_key(tiny_models, overrides, key, error):
    with pytest.raises(error) as info:
        AsyncRMConfig.from_verl(compose(tiny_models, *overrides))
    assert f"async_rm.{key}" in str(info.value)


def test_bad_verl_rm_keys_name_the_verl_key(tiny_models):
    # verl's default reward.reward_model.nnodes is 0: a pool size the user must set.
    with pytest.raises(ValueError, match=r"reward\.reward_model\.nnodes=0"):
        AsyncRMConfig.from_verl(compose(tiny_models, "reward.reward_model.nnodes=0"))
    with pytest.raises(ValueError, match=r"reward\.reward_model\.model_path"):
        AsyncRMConfig.from_verl(compose(tiny_models, "reward.reward_model.model_path=null"))


def test_async_rm_must_be_a_group(tiny_models):
    with pytest.raises(ValueError, match=r"async_rm=5: it must be a group of keys"):
        AsyncRMConfig.from_verl(compose(tiny_models, "+async_rm=5"))


# --- RewardMix ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"rm_weight": True}, "rm_weight"),
        ({"rm_weight": math.inf}, "rm_weight"),
        ({"rule_weight": "1"}, "rule_weight"),
        ({"rule_weight": math.nan}, "rule_weight"),
        ({"combine_fn": "module_only"}, "combine_fn"),
        ({"combine_fn": ":fn"}, "combine_fn"),
        ({"combine_fn": "module:"}, "combine_fn"),
        ({"combine_fn": 5}, "combine_fn"),
    ],
)
def test_reward_mix_rejects_bad_values(kwargs, key):
    with pytest.raises(ValueError, match=rf"async_rm\.{key}"):
        RewardMix(**kwargs)


def test_reward_mix_weighted_sum_and_rule_use():
    mix = RewardMix(rm_weight=0.5, rule_weight=2)
    assert mix.combine(1.0, 3.0) == 6.5
    assert mix.uses_rule
    assert RewardMix().combine(0.25, 100.0) == 0.25  # defaults: RM only
    assert not RewardMix().uses_rule
    assert RewardMix(rule_weight=0, combine_fn="m:f").uses_rule  # a combine_fn gets the rule score


def test_combine_fn_is_loaded_by_name_and_gets_every_argument(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))
    mix = RewardMix(rm_weight=100.0, combine_fn="combine_fns:scaled")
    fn = mix.load_combine_fn()
    value = mix.combine(0.5, 2.0, data_source="abc", extra_info={"bonus": 0.25}, fn=fn)
    assert value == 10.0 * 0.5 + 2.0 + 3 + 0.25  # the weights do not apply when combine_fn is set
    assert RewardMix().load_combine_fn() is None


def test_combine_fn_may_return_a_numpy_float(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))
    mix = RewardMix(combine_fn="combine_fns:numpy_float")
    value = mix.combine(0.5, 0.25, fn=mix.load_combine_fn())
    assert type(value) is float and value == 0.75


@pytest.mark.parametrize("name", ["not_finite", "not_a_number"])
def test_combine_fn_returning_a_non_finite_value_raises(monkeypatch, name):
    monkeypatch.syspath_prepend(str(ASSETS))
    mix = RewardMix(combine_fn=f"combine_fns:{name}")
    with pytest.raises(ValueError, match=rf"async_rm\.combine_fn 'combine_fns:{name}' returned .*finite"):
        mix.combine(0.5, 1.0, fn=mix.load_combine_fn())


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("no_such_module_for_tests_xyz:fn", "cannot import module"),
        ("combine_fns:missing", "has no attribute 'missing'"),
        ("combine_fns:NOT_CALLABLE", "is not callable"),
    ],
)
def test_combine_fn_that_cannot_load_names_the_key(monkeypatch, spec, why):
    monkeypatch.syspath_prepend(str(ASSETS))
    with pytest.raises(ValueError, match=rf"async_rm\.combine_fn='{spec}': .*{why}"):
        RewardMix(combine_fn=spec).load_combine_fn()


# --- check_verl_config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_a_valid_config_passes(tiny_models, trainer):
    check_verl_config(compose(tiny_models, trainer=trainer))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["reward.reward_model.enable=True"],
            r"reward\.reward_model\.enable=True makes verl start its own vLLM/SGLang .* "
            r"Fix: set reward\.reward_model\.enable=False; the plugin then serves the RM on the reward pool",
        ),
        (  # the fix follows the layout in use
            ["reward.reward_model.enable=True", "reward.reward_model.enable_resource_pool=False"],
            r"Fix: set reward\.reward_model\.enable=False; the plugin then serves the RM on the policy's GPUs",
        ),
    ],
)
@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_each_verl_key_mistake_is_refused(tiny_models, trainer, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_verl_config(compose(tiny_models, *overrides, trainer=trainer))


@pytest.mark.parametrize("trainer", ["v1", "v0"])
def test_no_reward_pool_puts_the_rm_on_the_policys_gpus_on_either_trainer(tiny_models, trainer):
    policy_pool = ("reward.reward_model.enable_resource_pool=False", "trainer.n_gpus_per_node=4")
    with pytest.raises(ValueError, match=r"reward pool sized \(reward\.reward_model\.n_gpus_per_node=2, nnodes=1\).*"
                                         r"Fix: add reward\.reward_model\.enable_resource_pool=True"):
        check_verl_config(compose(tiny_models, *policy_pool, trainer=trainer))
    settings = check_verl_config(compose(tiny_models, *policy_pool, "reward.reward_model.nnodes=0", trainer=trainer))
    assert settings.rm.placement == "policy_pool" and settings.rm.num_replicas == 4


@pytest.mark.parametrize("trainer", ["v0", "v1"])
@pytest.mark.parametrize(("manager", "rule_weight"), [("naive", 1.0), ("dapo", 1.0), ("async_rm", 0.0)])
def test_any_verl_reward_manager_is_accepted_and_its_reward_counts_by_default(tiny_models, trainer, manager,
                                                                            rule_weight):
    settings = check_verl_config(compose(tiny_models, f"reward.reward_manager.name={manager}", trainer=trainer))
    assert settings.mix.rule_weight == rule_weight
    explicit = compose(tiny_models, f"reward.reward_manager.name={manager}", "+async_rm.rule_weight=0.25")
    assert check_verl_config(explicit).mix.rule_weight == 0.25


def test_a_custom_manager_loaded_by_importlib_is_accepted(tiny_models):
    config = compose(tiny_models, "reward.reward_manager.source=importlib",
                     f"reward.reward_manager.module.path={ASSETS / 'custom_manager.py'}",
                     "reward.reward_manager.name=BonusRewardManager")
    assert check_verl_config(config).mix.rule_weight == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.reward_manager.name=dapoo"],
         r"reward\.reward_manager\.name='dapoo' \(source='register'\) does not resolve to a reward manager: "
         r"ValueError: Unknown reward manager: dapoo\. Fix: use a registered manager \(.*async_rm.*dapo.*naive"),
        (["reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={ASSETS / 'rules.py'}",
          "reward.reward_manager.name=NoSuchManager"],
         r"reward\.reward_manager\.name='NoSuchManager' \(source='importlib'\) does not resolve.*Fix: "
         r"reward\.reward_manager\.module\.path must name a Python file that defines"),
    ],
)
def test_a_reward_manager_that_does_not_resolve_is_refused_before_anything_starts(tiny_models, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_verl_config(compose(tiny_models, *overrides))


# --- several RMs: async_rm.models.<name>.* ---------------------------------------------------------------------------


def test_extra_rms_get_their_own_pool_weight_and_options_and_inherit_the_top_level_ones(tiny_models):
    config = compose(
        tiny_models, "+async_rm.rm_weight=2", "+async_rm.max_length=512", "+async_rm.max_batch_size=8",
        f"+async_rm.models.safety.model_path={tiny_models.rm_alt}", "+async_rm.models.safety.weight=0.5",
        "+async_rm.models.safety.max_length=256", "+async_rm.models.safety.n_gpus_per_node=3",
        "+async_rm.models.safety.max_wait_ms=7", f"+async_rm.models.helpful.model_path={tiny_models.rm}",
    )
    settings = check_verl_config(config)
    main, safety, helpful = settings.models
    assert [e.name for e in settings.models] == ["main", "safety", "helpful"]
    assert (main.rm, main.batching, main.weight, main.key) == (settings.rm, settings.batching, 2.0,
                                                                "reward.reward_model")
    assert safety.rm.model_path == str(tiny_models.rm_alt) and safety.key == "async_rm.models.safety"
    assert (safety.weight, safety.rm.max_length, safety.rm.n_gpus_per_node, safety.rm.nnodes) == (0.5, 256, 3, 1)
    assert (safety.batching.max_wait_ms, safety.batching.max_batch_size) == (7, 8)
    assert safety.batching.batch_timeout_s == 600.0  # the plugin's default reaches every RM
    assert safety.rm.policy_tokenizer_path == str(tiny_models.policy) and safety.rm.use_gpu is False
    # not set under its name: the top-level value, and the pool is one replica (the top never sizes a pool)
    assert (helpful.weight, helpful.rm.max_length, helpful.rm.num_replicas) == (1.0, 512, 1)
    assert settings.mix.weights == {"main": 2.0, "safety": 0.5, "helpful": 1.0}


def test_an_extra_rm_of_another_kind_takes_none_of_the_top_levels_keys_of_a_kind(tiny_models, tiny_judges):
    """A logits judge at the top with a group judge beside it (whose kind refuses judge_tokens) and a logits judge
    beside it (which takes the top's judge keys)."""
    judge = [f"reward.reward_model.model_path={tiny_judges.digit}", "+async_rm.reward_kind=judge",
             "+async_rm.judge_tokens=['1','2']", "+async_rm.judge_prompt='Q: {{ prompt }} A: {{ response }}'",
             "+async_rm.judge_max_tokens=8", "+async_rm.max_length=512"]
    config = compose(tiny_models, *judge, f"+async_rm.models.group.model_path={tiny_judges.json}",
                     "+async_rm.models.group.reward_kind=group_judge",
                     f"+async_rm.models.twin.model_path={tiny_judges.digit}")
    main, group, twin = check_verl_config(config).models
    assert (group.rm.judge_tokens, group.rm.judge_readout, group.rm.judge_max_tokens) == (None, "generate", 256)
    assert "{{ responses }}" in group.rm.judge_prompt and group.rm.max_length == 512  # not a key of a kind
    assert (twin.rm.judge_tokens, twin.rm.judge_prompt, twin.rm.judge_max_tokens) == (
        main.rm.judge_tokens, main.rm.judge_prompt, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+async_rm.models.main.model_path=/m"], r"async_rm\.models\.main: the name 'main' is taken by the RM of "
                                                  r"reward\.reward_model"),
        (["+async_rm.models.safety.weight=0.5"], r"async_rm\.models\.safety\.model_path=None: each extra RM needs "
                                                 r"its path \(or an endpoint\); set \+async_rm\.models\.safety\."
                                                 r"model_path=/path/to/rm, or \+async_rm\.models\.safety\.endpoint="),
        (["+async_rm.models.group.model_path=/m", "+async_rm.models.group.reward_kind=group_judge",
          "+async_rm.models.group.group_wait_s=2000"],
         r"async_rm\.models\.group\.group_wait_s=2000\.0: a short group .* past the request_timeout_s=1800 .* Fix: "
         r"set it well below 1800"),
        (["+async_rm.models.safety.model_path=/m", "+async_rm.models.safety.weight=nan"],
         r"async_rm\.models\.safety\.weight=nan: must be a finite number"),
        (["+async_rm.models.safety.model_path=/m", "+async_rm.models.safety.weight=high"],
         r"async_rm\.models\.safety\.weight='high': must be a finite number"),
        (["+async_rm.models.safety.model_path=/m", "+async_rm.models.safety.max_lenght=5"],
         r"unknown key async_rm\.models\.safety\.max_lenght=5 \(did you mean async_rm\.models\.safety\."
         r"max_length\?\); known keys: .*max_length"),
        (["+async_rm.models.safety.model_path=/m", "+async_rm.models.safety.use_gpu=false"],
         r"async_rm\.models\.safety\.use_gpu=False is not set per RM: .*trainer\.device"),
        (["+async_rm.models.safety.model_path=/m", "+async_rm.models.safety.nnodes=0"],
         r"async_rm\.models\.safety\.nnodes=0: the reward pool needs at least one node"),
        (["+async_rm.models.safety.model_path=/m", "+async_rm.models.safety.max_batch_size=0"],
         r"async_rm\.models\.safety\.max_batch_size"),
        (["+async_rm.models.safety.model_path=/m", "+async_rm.dtype=float8"], r"async_rm\.dtype='float8'"),
        (["+async_rm.models.safety=/m"], r"async_rm\.models\.safety='/m': it must be a group of keys"),
        (["+async_rm.models=/m"], r"async_rm\.models='/m': it must be a group of RMs by name"),
    ],
)
def test_bad_extra_rms_name_the_key_and_the_fix(tiny_models, overrides, message):
    with pytest.raises(ValueError, match=message):
        AsyncRMConfig.from_verl(compose(tiny_models, *overrides))


@pytest.mark.parametrize("name", ["2nd", "safety v2", "a/b"])
def test_an_rm_name_must_make_a_metric_and_reward_key(name):
    from verl_async_rm.config import extra_rm_entries

    with pytest.raises(ValueError, match=rf"async_rm\.models\.{re.escape(name)}: an RM name must start with a letter"):
        extra_rm_entries({name: {"model_path": "/m"}}, base={"policy_tokenizer_path": "/p"}, shared_rm={},
                         shared_batching={}, group="async_rm")


def test_an_extra_rm_that_is_a_causal_lm_is_refused_under_its_own_key(tiny_models):
    config = compose(tiny_models, f"+async_rm.models.safety.model_path={tiny_models.policy}")
    with pytest.raises(ValueError, match=r"async_rm\.models\.safety\.model_path="):
        check_verl_config(config)


@pytest.mark.parametrize(
    ("legacy", "new"),
    [
        ("reward_model.enable_resource_pool=True", "reward.reward_model.enable_resource_pool=True"),
        ("reward_model.n_gpus_per_node=4", "reward.reward_model.n_gpus_per_node=4"),
        ("reward_model.nnodes=2", "reward.reward_model.nnodes=2"),
        ("reward_model.model.path=/models/rm", "reward.reward_model.model_path=/models/rm"),
        ("reward_model.reward_manager=async_rm", "reward.reward_manager.name=async_rm"),
        ("custom_reward_function.path=/rules/r.py", "reward.custom_reward_function.path=/rules/r.py"),
    ],
)
def test_legacy_keys_are_refused_naming_the_entry_module_and_the_new_key(tiny_models, legacy, new):
    with pytest.raises(ValueError) as info:
        check_verl_config(compose(tiny_models, legacy))
    message = str(info.value)
    assert f"legacy keys {legacy} are set" in message
    assert "`python -m verl_async_rm.main_ppo`" in message
    assert message.endswith(f"write them as {new}")


def test_options_reference_documents_every_async_rm_key():
    """The docs' options reference (generated from the dataclasses) cannot silently fall behind them."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from verl_async_rm.config import _VERL_OWNED_RM_FIELDS, IntegrationConfig
    from verl_async_rm.service.batching import BatchPolicy
    from verl_async_rm.reward_mix import RewardMix
    from verl_async_rm.scoring.rm_config import RMConfig

    spec = importlib.util.spec_from_file_location(
        "gen_options", Path(__file__).resolve().parents[2] / "docs" / "hooks" / "gen_options.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    reference = generator.render()
    keys = {f.name for cls in (BatchPolicy, RMConfig, RewardMix, IntegrationConfig) for f in dataclasses.fields(cls)
            if not f.metadata.get("internal")}
    missing = sorted(k for k in keys - set(_VERL_OWNED_RM_FIELDS) if f"| `async_rm.{k}` |" not in reference)
    assert missing == []


def test_on_error_drop_on_the_v1_sync_trainer_needs_refills_before_anything_starts(tiny_models):
    """verl's sync replay buffer stops the run on a group whose every trajectory failed unless it may refill it."""
    from verl_async_rm.integration.v1 import AsyncRMAgentLoopManagerV1

    config = compose(tiny_models, "+async_rm.on_error=drop", trainer="v1")
    assert AsyncRMConfig.from_verl(config).integration.on_error == "drop"
    with pytest.raises(ValueError, match=r"trainer.v1.sampler.sync_refill_failed_groups=True"):
        AsyncRMAgentLoopManagerV1(config, llm_client=None)  # raises before the RM pool or any worker is started


def test_the_batch_timeout_can_be_turned_off(tiny_models):
    assert AsyncRMConfig.from_verl(compose(tiny_models)).batching.batch_timeout_s == 600.0
    settings = AsyncRMConfig.from_verl(compose(tiny_models, "+async_rm.batch_timeout_s=null"))
    assert settings.batching.batch_timeout_s is None


def test_settings_are_frozen(tiny_models):
    import dataclasses

    settings = AsyncRMConfig.from_verl(compose(tiny_models))
    for part in (settings, settings.batching, settings.rm, settings.mix, settings.integration):
        with pytest.raises(dataclasses.FrozenInstanceError):
            object.__getattribute__(part, "__setattr__")(dataclasses.fields(part)[0].name, None)
