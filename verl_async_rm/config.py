"""The plugin's config, read once at the boundary into frozen dataclasses, one per component
(:func:`option_groups`): verl's reward keys plus one flat ``async_rm`` group, and one :class:`RMEntry` per RM. A
``ConfigValueError`` raised under a field's name is renamed once, by :func:`build`, to the key the user wrote."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import ConfigValueError
from verl_async_rm.reward_mix import MAIN, RewardMix
from verl_async_rm.options import Rule, check_options, option, select
from verl_async_rm.scoring.rm_config import KIND_KEYS, LOADED_ONLY_KEYS, RMConfig
from verl_async_rm.service.batching import BatchPolicy

__all__ = ["AsyncRMConfig", "IntegrationConfig", "RMEntry", "MAIN", "CONFIG_GROUP", "ON_ERROR_MODES",
           "option_groups", "rm_config_from_verl", "placement_values", "extra_rm_entries", "build", "user_fields"]

CONFIG_GROUP = "async_rm"
MODELS_KEY = "models"
#: The plugin's own reward manager (``integration/reward_manager.py``); any other verl manager may be used instead.
ASYNC_RM_MANAGER = "async_rm"
ON_ERROR_MODES = ("raise", "drop")

#: RMConfig fields that come from verl's keys, never from ``async_rm.*``: what to set instead.
_VERL_OWNED_RM_FIELDS = {
    "model_path": "the RM path comes from verl's key; set reward.reward_model.model_path instead",
    "n_gpus_per_node": "the reward pool's size comes from verl's keys; set reward.reward_model.n_gpus_per_node "
    "instead",
    "nnodes": "the reward pool's size comes from verl's keys; set reward.reward_model.nnodes instead",
    "use_gpu": "RM replicas use GPUs unless trainer.device=cpu; set trainer.device instead",
}
#: Where verl keeps each RMConfig field it owns (the first key set). Legacy keys (``reward_model.*``) are not read:
#: verl's ``migrate_legacy_reward_impl`` moves them (``python -m verl_async_rm.main_ppo``), else they are refused.
_VERL_KEYS = {
    "model_path": ("reward.reward_model.model_path",), "n_gpus_per_node": ("reward.reward_model.n_gpus_per_node",),
    "nnodes": ("reward.reward_model.nnodes",),
    "policy_tokenizer_path": ("actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path")}
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
#: Per-RM keys that are the RM's own (never taken from the top of ``async_rm``).
_OWN_KEYS = ("model_path", "n_gpus_per_node", "nnodes", "gpus_per_replica", "weight", "endpoint", "endpoint_model",
             "api_key_env", "max_concurrency", "max_rpm", "max_tpm")
_WEIGHT = Rule(float, why="must be a finite number", fix="e.g. +{key}=0.5")


@dataclass(frozen=True)
class IntegrationConfig:
    """Settings of the agent-loop integration itself."""

    request_timeout_s: float = option(
        1800.0, "Longest a trajectory waits for its RM score (queue + RM call) before it fails with "
        "RequestTimeoutError.", above=0, why="must be a positive number of seconds", fix="e.g. +{key}=1800")
    on_error: str = option(
        "raise", "What a failed RM score does. 'raise': the run stops naming the trajectory (v1: at the step's end, "
        "verl having left its group out; v0: the step fails). 'drop': the run goes on without it (v1: verl's "
        "failure path, padded or refilled; v0: masked out, its group's mean as reward), unless more than "
        "drop_budget of a step is dropped (TrajectoryDroppedError).",
        choices=ON_ERROR_MODES, why="is not one of ('raise', 'drop')", fix="e.g. +{key}=raise")
    drop_budget: float = option(
        0.05, "With on_error='drop': the largest fraction of a step's trajectories that may be dropped.",
        least=0, most=1, why="must be a fraction in [0, 1]", fix="e.g. +{key}=0.05")
    replace_replicas: bool = option(
        True, "Start a new RM replica in the bundle of one that died (the others take its requests meanwhile); False "
        "retires it.")
    service_max_concurrency: int = option(
        100_000, "Ray max_concurrency of the RM service actor: the most trajectories that may wait on it at once "
        "(the queue's bound).", least=16,
        fix="set an integer >= 16: it bounds how many trajectories may wait for a score at once, e.g. 100000")

    def __post_init__(self) -> None:
        check_options(self, prefix=f"{CONFIG_GROUP}.")


@dataclass(frozen=True)
class RMEntry:
    """One RM of the run: its name, weight, where it is (``rm``) and how its requests are batched."""

    name: str
    weight: float
    rm: RMConfig
    batching: BatchPolicy
    #: Where its settings come from, for messages: ``reward.reward_model`` or ``async_rm.models.<name>``.
    key: str


def option_groups() -> dict[str, tuple[type, ...]]:
    """The user's key prefixes and the dataclasses whose fields they set, for the options reference
    (``async_rm.models.<name>.`` also takes ``weight``; fields marked ``internal`` are not keys)."""
    return {
        f"{CONFIG_GROUP}.": (BatchPolicy, RMConfig, RewardMix, IntegrationConfig),
        f"{CONFIG_GROUP}.{MODELS_KEY}.<name>.": (BatchPolicy, RMConfig)}


def build(cls: type, values: Mapping[str, Any], keys: Mapping[str, str]) -> Any:
    """``cls(**values)``; a ``ConfigValueError`` is renamed once, to ``keys[field]`` (the key the user wrote)."""
    try:
        return cls(**values)
    except ConfigValueError as err:
        raise err.renamed(keys.get(err.key, err.key)) from None


@dataclass(frozen=True)
class AsyncRMConfig:
    """Everything the plugin reads from verl's config, split per component."""

    batching: BatchPolicy
    rm: RMConfig
    mix: RewardMix
    integration: IntegrationConfig
    #: Every RM of the run, ``main`` (the one above: ``rm``, ``batching``) first, then ``async_rm.models.*``.
    models: tuple[RMEntry, ...] = ()

    @classmethod
    def from_verl(cls, config: Any) -> AsyncRMConfig:
        """Build from verl's whole trainer config (a ``DictConfig`` or nested mappings); ``ValueError`` naming the
        key, the value and the fix."""
        from omegaconf import DictConfig, OmegaConf

        group = select(config, CONFIG_GROUP)
        if group is None:
            group = {}
        elif isinstance(group, DictConfig):
            group = OmegaConf.to_container(group, resolve=True)
        if not isinstance(group, Mapping):
            raise ValueError(
                f"{CONFIG_GROUP}={group!r}: it must be a group of keys; set them one by one, e.g. "
                f"+{CONFIG_GROUP}.max_batch_size=64")
        group = dict(group)
        models = group.pop(MODELS_KEY, None)
        sections: dict[type, dict[str, Any]] = {BatchPolicy: {}, RMConfig: {}, RewardMix: {}, IntegrationConfig: {}}
        owner = {name: cls for cls in sections for name in user_fields(cls)}
        for key, value in group.items():
            if key in _VERL_OWNED_RM_FIELDS:
                raise ValueError(f"{CONFIG_GROUP}.{key}={value!r} is not read: {_VERL_OWNED_RM_FIELDS[key]}")
            _check_key(CONFIG_GROUP, key, value, {*(k for k in owner if k not in _VERL_OWNED_RM_FIELDS), MODELS_KEY})
            sections[owner[key]][key] = value
        batching_values = sections[BatchPolicy]
        batching = build(BatchPolicy, batching_values, _under(CONFIG_GROUP, batching_values))
        rm = rm_config_from_verl(config, sections[RMConfig], overrides_key=CONFIG_GROUP)
        base = {"policy_tokenizer_path": rm.policy_tokenizer_path, "use_gpu": rm.use_gpu}
        if rm.placement == "policy_pool":  # every RM where the main one is (placement_values, read once)
            base.update({k: getattr(rm, k) for k in ("placement", "n_gpus_per_node", "nnodes",
                                                     "rollout_memory_utilization", "actor_resident_bytes")})
        extras = extra_rm_entries(models, base=base, shared_rm=sections[RMConfig], shared_batching=batching_values,
                                  group=CONFIG_GROUP)
        mix_values = sections[RewardMix]
        manager = select(config, "reward.reward_manager.name") or select(config, "reward_model.reward_manager")
        if "rule_weight" not in mix_values and manager != ASYNC_RM_MANAGER:
            mix_values["rule_weight"] = 1.0  # the user's own reward manager: its reward counts unless told otherwise
        named = [(MAIN, rm), *((e.name, e.rm) for e in extras)]
        token_level = tuple(name for name, c in named if c.token_level)
        verdict = tuple(name for name, c in named if c.writes or c.grouped)
        groups = tuple(name for name, c in named if c.grouped)
        mix = RewardMix(**mix_values, extra_weights=tuple((e.name, e.weight) for e in extras),
                        token_level_rms=token_level, verdict_rms=verdict, group_rms=groups)
        main = RMEntry(name=MAIN, weight=mix.rm_weight, rm=rm, batching=batching, key="reward.reward_model")
        integration = IntegrationConfig(**sections[IntegrationConfig])
        timeout_s = integration.request_timeout_s
        for entry in (main, *extras):  # a group judge's short groups are judged before their members' deadlines
            if entry.rm.grouped and entry.rm.group_wait_s >= timeout_s:
                raise ConfigValueError(
                    f"{CONFIG_GROUP if entry.name == MAIN else entry.key}.group_wait_s", entry.rm.group_wait_s,
                    "a short group (a sibling that never comes) is judged this long after its last member, past the "
                    f"request_timeout_s={timeout_s:g} its members wait at most",
                    f"set it well below {timeout_s:g}, e.g. 300, or raise {CONFIG_GROUP}.request_timeout_s")
        return cls(batching=batching, rm=rm, mix=mix, integration=integration, models=(main, *extras))


def rm_config_from_verl(config: Any, overrides: Mapping[str, Any] | None = None, overrides_key: str = "") -> RMConfig:
    """:class:`RMConfig` from verl's trainer config: the fields of :data:`_VERL_KEYS` and ``use_gpu``
    (``trainer.device != "cpu"``), then ``overrides`` (RMConfig fields, from ``overrides_key``, e.g. ``async_rm``).
    Errors name the key the value was read from."""
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for name, candidates in _VERL_KEYS.items():
        key = next((k for k in candidates if select(config, k) is not None), None)
        if key is not None:
            values[name], keys[name] = select(config, key), key
    device = select(config, "trainer.device")
    if device is not None:
        values["use_gpu"], keys["use_gpu"] = str(device) != "cpu", "trainer.device"
    known = user_fields(RMConfig)
    prefix = f"{overrides_key}." if overrides_key else ""
    for name, value in dict(overrides or {}).items():
        if name not in known:
            raise ConfigValueError(
                f"{prefix}{name}", value, "not a setting of the RM worker group", f"use one of {sorted(known)}")
        values[name], keys[name] = value, f"{prefix}{name}"
    values["kind_given"] = "reward_kind" in values
    if "model_path" not in values and "endpoint" not in values:
        raise ConfigValueError("reward.reward_model.model_path", None, "the plugin needs a reward model",
                               "set reward.reward_model.model_path=/path/to/rm, or +async_rm.endpoint to the URL of "
                               "a server that serves it")
    values.update(placement_values(config))
    return build(RMConfig, values, keys)


def placement_values(config: Any) -> dict[str, Any]:
    """RMConfig fields of where the replicas run: nothing for a pool of their own; with
    ``reward.reward_model.enable_resource_pool=False``, one replica per GPU of the policy's pool and the memory check's
    inputs (:mod:`~verl_async_rm.scoring.colocation`)."""
    from verl_async_rm.scoring.colocation import actor_resident_bytes

    enable_pool = select(config, "reward.reward_model.enable_resource_pool")
    if enable_pool is None or enable_pool:
        return {}
    utilization = select(config, "actor_rollout_ref.rollout.gpu_memory_utilization")
    return {
        "placement": "policy_pool", "n_gpus_per_node": int(select(config, "trainer.n_gpus_per_node") or 1),
        "nnodes": int(select(config, "trainer.nnodes") or 1),
        "rollout_memory_utilization": None if utilization is None else float(utilization),
        "actor_resident_bytes": actor_resident_bytes(config)}


def _kind(values: Mapping[str, Any]) -> tuple[Any, Any]:
    """An RM's kind, from its keys: ``(reward_kind, judge_readout)``."""
    kind = values.get("reward_kind", "outcome")
    return kind, values.get("judge_readout") or ("logits" if kind == "judge" else None)


def extra_rm_entries(models: Any, *, base: Mapping[str, Any], shared_rm: Mapping[str, Any],
                     shared_batching: Mapping[str, Any], group: str) -> tuple[RMEntry, ...]:
    """Parse ``async_rm.models`` (name -> options) into entries, in the order given. ``base``: RMConfig fields
    every RM takes from verl; ``shared_rm``, ``shared_batching``: the options set at the top of ``async_rm``."""
    if models is None:
        return ()
    if not isinstance(models, Mapping):
        raise ValueError(
            f"{group}.{MODELS_KEY}={models!r}: it must be a group of RMs by name; set each one's keys, e.g. "
            f"+{group}.{MODELS_KEY}.safety.model_path=/path/to/rm")
    rm_fields = user_fields(RMConfig) - {"use_gpu"}
    batching_fields = user_fields(BatchPolicy)
    entries = []
    for name, options in models.items():
        key = f"{group}.{MODELS_KEY}.{name}"
        if name == MAIN:
            raise ValueError(
                f"{key}: the name '{MAIN}' is taken by the RM of reward.reward_model.* (weighted by {group}.rm_weight);"
                f" give this RM another name, e.g. {group}.{MODELS_KEY}.safety")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"{key}: an RM name must start with a letter and hold only letters, digits and '_' (it names the "
                "rm_score_<name> reward key and the async_rm/<name>/ metrics), e.g. safety")
        if not isinstance(options, Mapping):
            raise ValueError(
                f"{key}={options!r}: it must be a group of keys; set them one by one, e.g. +{key}.model_path=/path")
        # an extra RM served at an endpoint takes none of the main RM's settings of a loaded model (dtype, engine...),
        # one of another kind none of the keys of the main one's kind (a logits judge's judge_tokens...)
        inherited = _OWN_KEYS + (LOADED_ONLY_KEYS if options.get("endpoint") else ()) + (
            KIND_KEYS if _kind({**shared_rm, **options}) != _kind(shared_rm) else ())
        rm_values = {k: v for k, v in shared_rm.items() if k not in inherited}
        batching_values = dict(shared_batching)
        for option_name, value in options.items():
            if option_name == "use_gpu":
                raise ValueError(f"{key}.use_gpu={value!r} is not set per RM: RM replicas use GPUs unless "
                                 "trainer.device=cpu, for every RM; set trainer.device")
            _check_key(key, option_name, value, {*rm_fields, *batching_fields, "weight"})
            if option_name in rm_fields:
                rm_values[option_name] = value
            elif option_name in batching_fields:
                batching_values[option_name] = value
        weight = _WEIGHT.convert(f"{key}.weight", options.get("weight", 1.0))
        if not options.get("model_path") and not options.get("endpoint"):
            raise ValueError(
                f"{key}.model_path={options.get('model_path')!r}: each extra RM needs its path (or an endpoint); "
                f"set +{key}.model_path=/path/to/rm, or +{key}.endpoint=http://host:port/v1")
        for own in ("n_gpus_per_node", "nnodes"):  # the top of async_rm never sizes a pool (verl's keys do)
            if own in options and base.get("placement") == "policy_pool":  # every RM on the policy's GPUs, one each
                raise ValueError(
                    f"{key}.{own}={options[own]!r}: with reward.reward_model.enable_resource_pool=False every RM "
                    "has one replica on each of the policy's GPUs (trainer.n_gpus_per_node x trainer.nnodes). "
                    f"Fix: remove {key}.{own}, or give the RMs pools of their own "
                    "(reward.reward_model.enable_resource_pool=True)")
            rm_values.setdefault(own, base.get(own, 1))
        keys = {**_under(group, shared_rm), **_under(key, {**options, **dict.fromkeys(_OWN_KEYS)})}
        rm = build(RMConfig, {**base, **rm_values, "kind_given": "reward_kind" in rm_values}, keys)
        batching = build(BatchPolicy, batching_values, _under(key, batching_values))
        entries.append(RMEntry(name=name, weight=weight, rm=rm, batching=batching, key=key))
    return tuple(entries)


def _under(prefix: str, names: Any) -> dict[str, str]:
    return {name: f"{prefix}.{name}" for name in names}


def user_fields(cls: type) -> set[str]:
    """The fields of option dataclass ``cls`` a user may set: all but those marked ``internal`` (the plugin sets
    those itself, from verl's keys)."""
    return {f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _check_key(prefix: str, key: str, value: Any, known: set[str]) -> None:
    """The one check of a user's key under ``prefix`` (the top of ``async_rm``, or one RM of ``async_rm.models``):
    ``known`` holds user keys only, so an internal field is refused like a misspelt key; a close key is suggested."""
    if key not in known:
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f" (did you mean {prefix}.{close[0]}?)" if close else ""
        raise ValueError(f"unknown key {prefix}.{key}={value!r}{hint}; known keys: {', '.join(sorted(known))}")
