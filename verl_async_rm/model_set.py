"""The reward models of a run: ``main`` (verl's ``reward.reward_model.*`` keys) and each ``async_rm.models.<name>``.

Each RM gets its own pool, replicas and batcher (one RM service each) and a weight in the reward. An extra RM is set
with flat keys under its name::

    +async_rm.models.safety.model_path=/models/safety-rm
    +async_rm.models.safety.n_gpus_per_node=1     # default 1
    +async_rm.models.safety.nnodes=1              # default 1
    +async_rm.models.safety.gpus_per_replica=1    # default 1: GPUs per replica (an RM too big for one GPU)
    +async_rm.models.safety.weight=0.5            # default 1.0
    +async_rm.models.safety.max_length=4096       # any RM or batching option of async_rm.*

An option not set under the RM's name takes the value set at the top (``async_rm.<option>``), else its default; the
RM path, the pool's size and shape (``gpus_per_replica``) and the weight are the RM's own. ``main`` is weighted by
``async_rm.rm_weight``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_async_rm.batching.policy import BatchPolicy
from verl_async_rm.scoring.rm_config import ConfigValueError, RMConfig

__all__ = ["MAIN", "RMEntry", "extra_rm_entries"]

#: The name of the RM set by verl's ``reward.reward_model.*`` keys.
MAIN = "main"
MODELS_KEY = "models"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
#: Per-RM keys that are the RM's own (never taken from the top of ``async_rm``).
_OWN_KEYS = ("model_path", "n_gpus_per_node", "nnodes", "gpus_per_replica", "weight")
#: RM options that are not set per model.
_NOT_PER_MODEL = {"use_gpu": "RM replicas use GPUs unless trainer.device=cpu, for every RM; set trainer.device"}


@dataclass(frozen=True)
class RMEntry:
    """One RM of the run: its name, weight, where it is (``rm``) and how its requests are batched."""

    name: str
    weight: float
    rm: RMConfig
    batching: BatchPolicy
    #: Where its settings come from, for messages: ``reward.reward_model`` or ``async_rm.models.<name>``.
    key: str


def extra_rm_entries(
    models: Any, *, base: Mapping[str, Any], shared_rm: Mapping[str, Any], shared_batching: Mapping[str, Any],
    group: str,
) -> tuple[RMEntry, ...]:
    """Parse ``async_rm.models`` (a mapping of name -> options) into entries, in the order given.

    Args:
        models: the ``async_rm.models`` node.
        base: RMConfig fields every RM shares that come from verl (``policy_tokenizer_path``, ``use_gpu``).
        shared_rm: RMConfig options set at the top of ``async_rm`` (the defaults of every RM).
        shared_batching: BatchPolicy options of the top of ``async_rm`` (plugin defaults included).
        group: ``async_rm``, for key names in messages.

    Raises:
        ValueError: a name, key or value is bad; the message names the key (``async_rm.models.<name>.<key>``).
    """
    if models is None:
        return ()
    if not isinstance(models, Mapping):
        raise ValueError(
            f"{group}.{MODELS_KEY}={models!r}: it must be a group of RMs by name; set each one's keys, e.g. "
            f"+{group}.{MODELS_KEY}.safety.model_path=/path/to/rm"
        )
    rm_fields = {f.name for f in dataclasses.fields(RMConfig)} - set(_NOT_PER_MODEL)
    batching_fields = {f.name for f in dataclasses.fields(BatchPolicy)}
    entries = []
    for name, options in models.items():
        key = f"{group}.{MODELS_KEY}.{name}"
        if name == MAIN:
            raise ValueError(
                f"{key}: the name '{MAIN}' is taken by the RM of reward.reward_model.* (weighted by {group}.rm_weight);"
                f" give this RM another name, e.g. {group}.{MODELS_KEY}.safety"
            )
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"{key}: an RM name must start with a letter and hold only letters, digits and '_' (it names the "
                "rm_score_<name> reward key and the async_rm/<name>/ metrics), e.g. safety"
            )
        if not isinstance(options, Mapping):
            raise ValueError(
                f"{key}={options!r}: it must be a group of keys; set them one by one, e.g. +{key}.model_path=/path"
            )
        rm_values = {k: v for k, v in shared_rm.items() if k not in _OWN_KEYS}
        batching_values = dict(shared_batching)
        weight = 1.0
        for option, value in options.items():
            if option == "weight":
                weight = value
            elif option in _NOT_PER_MODEL:
                raise ValueError(f"{key}.{option}={value!r} is not set per RM: {_NOT_PER_MODEL[option]}")
            elif option in rm_fields:
                rm_values[option] = value
            elif option in batching_fields:
                batching_values[option] = value
            else:
                known = sorted({*rm_fields, *batching_fields, "weight"})
                raise ValueError(f"unknown key {key}.{option}={value!r}; known keys: {', '.join(known)}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{key}.weight={weight!r}: must be a finite number; e.g. +{key}.weight=0.5")
        if not options.get("model_path"):
            raise ValueError(
                f"{key}.model_path={options.get('model_path')!r}: each extra RM needs its path; "
                f"set +{key}.model_path=/path/to/rm"
            )
        rm_values.setdefault("n_gpus_per_node", 1)  # the top of async_rm never sizes a pool (verl's keys do)
        rm_values.setdefault("nnodes", 1)
        try:
            rm = RMConfig(**{**base, **rm_values})
        except ConfigValueError as err:
            where = key if err.key in options or err.key in _OWN_KEYS else (
                group if err.key in shared_rm else "")
            raise err.renamed(f"{where}.{err.key}" if where else err.key) from None
        try:
            batching = BatchPolicy(**batching_values)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("BatchPolicy.", f"{key}.")) from None
        entries.append(RMEntry(name=name, weight=float(weight), rm=rm, batching=batching, key=key))
    return tuple(entries)
