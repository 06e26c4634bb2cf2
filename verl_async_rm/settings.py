"""The plugin's config surface: verl's reward keys plus one flat ``async_rm`` group, parsed once per process.

Users write flat keys on verl's command line (``+async_rm.max_batch_size=64 +async_rm.rm_weight=1.0``);
:meth:`AsyncRMConfig.from_verl` validates them once into frozen dataclasses, one per component, and each component
gets only its own:

- batching knobs -> :class:`verl_async_rm.batching.BatchPolicy` (the RM service's batcher; ``batch_timeout_s`` is
  the one bound on a batch call, 600 s by default here);
- RM loading/feeding/placement knobs -> :class:`verl_async_rm.scoring.RMConfig` (with verl's ``reward.reward_model.*``
  keys and their legacy ``reward_model.*`` spellings, see :func:`verl_async_rm.scoring.rm_config_from_verl`);
- reward weights -> :class:`verl_async_rm.integration.reward_mix.RewardMix` (``rule_weight`` defaults to 0.0 with the
  ``async_rm`` reward manager and to 1.0 with any other, whose reward is then counted as it is);
- more RMs (``async_rm.models.<name>.*``) -> one :class:`verl_async_rm.model_set.RMEntry` each, after ``main``;
- the rest (the trajectory's wait, error policy, the service actor) -> :class:`IntegrationConfig`.

Unknown ``async_rm`` keys raise ``ValueError`` listing the known ones, and keys of earlier releases name their
replacement, so a typo or a stale recipe never goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_async_rm.batching.policy import BatchPolicy
from verl_async_rm.integration.reward_mix import RewardMix
from verl_async_rm.model_set import MAIN, MODELS_KEY, RMEntry, extra_rm_entries
from verl_async_rm.scoring.rm_config import RMConfig, _select, rm_config_from_verl

__all__ = ["AsyncRMConfig", "IntegrationConfig", "CONFIG_GROUP", "ON_ERROR_MODES"]

CONFIG_GROUP = "async_rm"
#: The plugin's own reward manager (``integration/reward_manager.py``); any other verl manager may be used instead.
ASYNC_RM_MANAGER = "async_rm"
ON_ERROR_MODES = ("raise", "drop")

# The RM worker group's path and placement come from verl's own keys, not from async_rm.*: what to set instead.
#: Keys of earlier releases: what to do instead.
_RETIRED_KEYS = {
    "score_timeout_s": "the one bound on a batch call is now async_rm.batch_timeout_s (same meaning, default 600)",
    "executor_max_concurrency": "the RM service's actor took over from the executor actor; set "
    "async_rm.service_max_concurrency",
    "pad_multiple": "there is no whole-group mode to pad for; remove the key",
    "bisect_on_error": "each RM replica isolates a failing item itself (its micro-batch is split, the others keep "
    "their scores); remove the key",
}
#: Batching defaults of the plugin that differ from the Ray-free executor's own.
_PLUGIN_BATCHING_DEFAULTS = {"batch_timeout_s": 600.0}

_VERL_OWNED_RM_FIELDS = {
    "model_path": "the RM path comes from verl's key; set reward.reward_model.model_path instead",
    "n_gpus_per_node": "the reward pool's size comes from verl's keys; set reward.reward_model.n_gpus_per_node "
    "instead",
    "nnodes": "the reward pool's size comes from verl's keys; set reward.reward_model.nnodes instead",
    "use_gpu": "RM replicas use GPUs unless trainer.device=cpu; set trainer.device instead",
}


@dataclass(frozen=True)
class IntegrationConfig:
    """Settings of the agent-loop integration itself."""

    request_timeout_s: float = field(
        default=1800.0,
        metadata={"help": "Longest a trajectory's agent-loop worker waits for its RM score (queue + RM call) before "
                          "it fails with RequestTimeoutError."},
    )
    on_error: str = field(
        default="raise",
        metadata={"help": "What a failed RM score does. 'raise': the run stops with the RM's error, naming the "
                          "trajectory (v1: at the end of the step, whose failed trajectory verl left out of "
                          "training; v0: the step fails). 'drop': the run goes on without it (v1: its group takes "
                          "verl's failure path, padded or refilled; v0: its response_mask is zeroed and its reward "
                          "set to its group's mean), rm_dropped/dropped count it, and more than drop_budget of a "
                          "step dropped stops the run with TrajectoryDroppedError."},
    )
    drop_budget: float = field(
        default=0.05,
        metadata={"help": "With on_error='drop': the largest fraction of a step's trajectories that may be dropped "
                          "before the step fails with TrajectoryDroppedError."},
    )
    replace_replicas: bool = field(
        default=True,
        metadata={"help": "Start a new RM replica in the bundle of one that died (its requests go to the other "
                          "replicas meanwhile); False retires it."},
    )
    service_max_concurrency: int = field(
        default=100_000,
        metadata={"help": "Ray max_concurrency of the RM service actor: the most trajectories that may wait on it "
                          "at once."},
    )

    def __post_init__(self) -> None:
        value = self.request_timeout_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"async_rm.request_timeout_s must be a positive number of seconds, got {value!r}; "
                "e.g. +async_rm.request_timeout_s=1800"
            )
        if self.on_error not in ON_ERROR_MODES:
            raise ValueError(
                f"async_rm.on_error={self.on_error!r} is not one of {ON_ERROR_MODES}; e.g. +async_rm.on_error=raise"
            )
        value = self.drop_budget
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(
                f"async_rm.drop_budget must be a fraction in [0, 1], got {value!r}; e.g. +async_rm.drop_budget=0.05"
            )
        if not isinstance(self.replace_replicas, bool):
            raise TypeError(f"async_rm.replace_replicas must be true or false, got {self.replace_replicas!r}")
        value = self.service_max_concurrency
        if isinstance(value, bool) or not isinstance(value, int) or value < 16:
            raise ValueError(
                f"async_rm.service_max_concurrency must be an integer >= 16, got {value!r}; it bounds how many "
                "trajectories may wait for a score at once, e.g. 100000"
            )


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
        """Build from verl's whole trainer config (a ``DictConfig`` or nested mappings).

        Raises:
            ValueError: a key is unknown or a value is bad; the message names the key, the value and the fix.
        """
        group = _group(config)
        models = group.pop(MODELS_KEY, None)
        sections: dict[type, dict[str, Any]] = {BatchPolicy: {}, RMConfig: {}, RewardMix: {}, IntegrationConfig: {}}
        owner = {f.name: kind for kind in sections for f in dataclasses.fields(kind) if not f.metadata.get("internal")}
        for key, value in group.items():
            if key in _RETIRED_KEYS:
                raise ValueError(f"{CONFIG_GROUP}.{key}={value!r} is no longer read: {_RETIRED_KEYS[key]}")
            if key in _VERL_OWNED_RM_FIELDS:
                raise ValueError(f"{CONFIG_GROUP}.{key}={value!r} is not read: {_VERL_OWNED_RM_FIELDS[key]}")
            if key not in owner:
                known = sorted({*(k for k in owner if k not in _VERL_OWNED_RM_FIELDS), MODELS_KEY})
                raise ValueError(f"unknown key {CONFIG_GROUP}.{key}={value!r}; known keys: {', '.join(known)}")
            sections[owner[key]][key] = value
        batching_values = {**_PLUGIN_BATCHING_DEFAULTS, **sections[BatchPolicy]}
        batching = _build(BatchPolicy, batching_values)
        rm = rm_config_from_verl(config, sections[RMConfig], overrides_key=CONFIG_GROUP)
        extras = extra_rm_entries(
            models, base={"policy_tokenizer_path": rm.policy_tokenizer_path, "use_gpu": rm.use_gpu},
            shared_rm=sections[RMConfig], shared_batching=batching_values, group=CONFIG_GROUP,
        )
        mix_values = sections[RewardMix]
        if "rule_weight" not in mix_values and _manager_name(config) != ASYNC_RM_MANAGER:
            mix_values["rule_weight"] = 1.0  # the user's own reward manager: its reward counts unless told otherwise
        token_level = tuple(e.name for e in extras if e.rm.token_level)
        token_level = (MAIN, *token_level) if rm.token_level else token_level
        mix = _build(RewardMix, {**mix_values, "extra_weights": tuple((e.name, e.weight) for e in extras),
                                 "token_level_rms": token_level})
        main = RMEntry(name=MAIN, weight=mix.rm_weight, rm=rm, batching=batching, key="reward.reward_model")
        return cls(
            batching=batching,
            rm=rm,
            mix=mix,
            integration=_build(IntegrationConfig, sections[IntegrationConfig]),
            models=(main, *extras),
        )


def _manager_name(config: Any) -> Any:
    return _select(config, "reward.reward_manager.name") or _select(config, "reward_model.reward_manager")


def _group(config: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    node = _select(config, CONFIG_GROUP)
    if node is None:
        return {}
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise ValueError(
            f"{CONFIG_GROUP}={node!r}: it must be a group of keys; set them one by one, e.g. "
            f"+{CONFIG_GROUP}.max_batch_size=64"
        )
    return dict(node)


def _build(kind: type, values: Mapping[str, Any]):
    """``kind(**values)``, with errors reported under the user's key names (``async_rm.<key>``)."""
    try:
        return kind(**values)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        if f"{kind.__name__}." in message:  # e.g. BatchPolicy's "BatchPolicy.max_batch_size must be ..."
            raise type(exc)(message.replace(f"{kind.__name__}.", f"{CONFIG_GROUP}.")) from None
        if f"{CONFIG_GROUP}." in message:
            raise
        raise type(exc)(f"{CONFIG_GROUP}: {message}") from None
