"""Checks of verl's own keys before anything starts, for mistakes that would fail late or silently: verl's own RM
servers enabled, the RM on the policy's GPUs where it cannot fit or sleep, legacy keys verl's ``main_ppo`` ignores, a
v1 trainer verl does not have, an RM checkpoint that is not what its kind says. Each is a ``ValueError`` naming the
key and fix."""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

from verl_async_rm.config import CONFIG_GROUP, MAIN, AsyncRMConfig
from verl_async_rm.errors import ConfigValueError
from verl_async_rm.options import select as _get
from verl_async_rm.scoring.checkpoint import check_rm_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["check_verl_config", "verl_v1", "probe_endpoints", "check_v1_trainer", "legacy_keys_set", "LEGACY_KEYS",
           "ENTRY_MODULE", "V1_TRAINER_MODES", "colocate_count"]

ENTRY_MODULE = "verl_async_rm.main_ppo"
#: Legacy top-level keys that verl 0.9.1's ``main_ppo`` ignores (all null in verl's defaults), with the keys
#: verl's ``migrate_legacy_reward_impl`` moves them to.
LEGACY_KEYS: dict[str, str] = {
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.enable_resource_pool": "reward.reward_model.enable_resource_pool",
    "reward_model.n_gpus_per_node": "reward.reward_model.n_gpus_per_node",
    "reward_model.nnodes": "reward.reward_model.nnodes",
    "reward_model.model.path": "reward.reward_model.model_path",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.reward_loop_source": "reward.reward_manager.source",
    "custom_reward_function.path": "reward.custom_reward_function.path",
    "custom_reward_function.name": "reward.custom_reward_function.name",
    "sandbox_fusion.url": "reward.sandbox_fusion.url",
}


def legacy_keys_set(config: Any) -> dict[str, Any]:
    """The legacy ``reward_model.*`` keys that are set (not null) in ``config``."""
    return {key: value for key in LEGACY_KEYS if (value := _get(config, key)) is not None}


def _once_per_config(check: Any) -> Any:
    """``check`` run once for a config's content in this process: verl's ``validate_config`` and the agent-loop manager
    both ask in one process on verl's v0 trainer (the last config that passed is kept)."""
    passed: dict[str, Any] = {}

    @functools.wraps(check)
    def checked(config: Any) -> AsyncRMConfig:
        from omegaconf import DictConfig, OmegaConf

        key = OmegaConf.to_yaml(config) if isinstance(config, DictConfig) else repr(config)
        if passed.get("key") != key:
            passed.update(settings=check(config), key=key)
        return passed["settings"]

    return checked


@_once_per_config
def check_verl_config(config: Any) -> AsyncRMConfig:
    """Raise ``ValueError`` if verl's config cannot work with the plugin (see module doc); else the parsed settings."""
    legacy = legacy_keys_set(config)
    if legacy:
        shown = " ".join(f"{k}={v}" for k, v in legacy.items())
        renamed = " ".join(f"{LEGACY_KEYS[k]}={v}" for k, v in legacy.items())
        raise ValueError(
            f"legacy keys {shown} are set, but verl's main_ppo ignores the top-level reward_model.* / "
            "custom_reward_function.* / sandbox_fusion.* keys, so the reward pool would not be reserved (and a rule "
            f"function would not be loaded). Launch with `python -m {ENTRY_MODULE}` (same overrides; it migrates "
            f"them), or write them as {renamed}")
    if _get(config, "reward.reward_model.enable"):
        own_pool = bool(_get(config, "reward.reward_model.enable_resource_pool"))
        where = ("on the reward pool (enable_resource_pool=True)" if own_pool
                 else "on the policy's GPUs (enable_resource_pool=False)")
        raise ValueError(
            "reward.reward_model.enable=True makes verl start its own vLLM/SGLang reward-model servers next to this "
            f"plugin's RM replicas. Fix: set reward.reward_model.enable=False; the plugin then serves the RM {where}")
    if _get(config, "trainer.use_v1"):
        verl_v1()
    _check_reward_manager(config)
    settings = AsyncRMConfig.from_verl(config)
    estimator = str(_get(config, "algorithm.adv_estimator") or "")
    for entry in settings.models:
        rm = entry.rm
        _refuse_hub_ids(config, entry)
        if rm.model_path and os.path.isdir(rm.model_path):
            try:
                check_rm_checkpoint(rm.model_path, rm.trust_remote_code, rm.reward_kind, rm.kind_given)
            except ConfigValueError as err:
                if entry.name != MAIN:
                    raise err.renamed(f"{entry.key}.{err.key}") from None
                raise err.renamed(f"{entry.key}.model_path" if err.key == "model_path" else
                                  f"{CONFIG_GROUP}.{err.key}") from None
        elif not rm.remote:  # multi-node runs may keep the RM only on the reward nodes: each replica checks it
            logger.warning(
                "verl_async_rm: RM %s's path %s is not a directory on this machine, so its checkpoint is not checked "
                "before the run; each replica checks it as it loads, on its own node (a path missing there fails the "
                "start). Fix, if the path is wrong: set %s to a local directory present on every node of its pool",
                entry.name, rm.model_path, f"{entry.key}.model_path")
        if rm.token_level and estimator in SUM_ONLY_ESTIMATORS:  # legitimate, but more steps earn more
            logger.warning(
                "verl_async_rm: RM %s has process_reduction=none with algorithm.adv_estimator=%s, which reads only "
                "the sum of a trajectory's token rewards: its reward is then the sum of its step scores, so a response "
                "with more steps earns more. With %s use process_reduction=min (the default; or mean, last, product); "
                "keep 'none' for an estimator that reads each token's reward (gae, reinforce_plus_plus, remax)",
                entry.name, estimator, estimator)
    _refuse_column_clashes(config, settings)
    _refuse_lone_validation_responses(config, settings)
    if settings.rm.remote and settings.rm.placement == "own_pool":
        gpus = f"{_get(config, 'reward.reward_model.n_gpus_per_node')} x {_get(config, 'reward.reward_model.nnodes')}"
        raise ValueError(
            "reward.reward_model.enable_resource_pool=True with the main RM at +async_rm.endpoint: verl would count a "
            f"reward pool of {gpus} GPUs (reward.reward_model.n_gpus_per_node x nnodes) that no replica uses, and "
            "wait for them to be free at start. Fix: set reward.reward_model.enable_resource_pool=False (extra RMs "
            "the plugin loads then share the policy's GPUs), or load the main RM and serve the remote one as an extra "
            "RM (+async_rm.models.<name>.endpoint=...)")
    if settings.rm.placement == "policy_pool" and any(not e.rm.remote for e in settings.models):
        _check_policy_pool(config, settings)
    return settings


def _check_policy_pool(config: Any, settings: AsyncRMConfig) -> None:
    """``reward.reward_model.enable_resource_pool=False``: the RMs' replicas go in the bundles of verl's actor/rollout
    pool, beside the actor's worker (:func:`colocate_count` processes fit in a bundle)."""
    sized = (_get(config, "reward.reward_model.n_gpus_per_node"), _get(config, "reward.reward_model.nnodes"))
    trainer = (_get(config, "trainer.n_gpus_per_node"), _get(config, "trainer.nnodes"))
    if sized[1] and sized != trainer:  # verl's default nnodes=0; verl copies the trainer's there at start
        raise ValueError(
            f"reward.reward_model.enable_resource_pool=False with a reward pool sized "
            f"(reward.reward_model.n_gpus_per_node={sized[0]}, nnodes={sized[1]}): without a pool of its own verl "
            f"replaces that size with the trainer's ({trainer[0]} x {trainer[1]}) and the RM runs on the policy's "
            "GPUs, one replica on each. Fix: add reward.reward_model.enable_resource_pool=True to give the RM those "
            "GPUs, or remove reward.reward_model.n_gpus_per_node / nnodes to share the policy's")
    mode = str(_get(config, "trainer.v1.trainer_mode") or "sync")
    if mode == "separate_async":
        raise ValueError(
            "reward.reward_model.enable_resource_pool=False with trainer.v1.trainer_mode=separate_async: that mode "
            "keeps the rollout on GPUs of its own, running through the policy's updates, so there is no rollout "
            "phase for the RM to share the trainer's GPUs with (verl refuses its own colocated RM there too). Fix: "
            "use trainer.v1.trainer_mode=sync or colocate_async, or give the RM its own pool "
            "(reward.reward_model.enable_resource_pool=True)")
    count = colocate_count()
    room = count - 1  # the actor's worker takes one place in each bundle
    local = [e for e in settings.models if not e.rm.remote]
    if len(local) > room:
        raise ValueError(
            f"reward.reward_model.enable_resource_pool=False with {len(local)} RMs "
            f"({', '.join(e.name for e in local)}): a bundle of verl's policy pool holds {count} processes (its "
            f"max_colocate_count), one of them the actor's, so at most {room} RMs fit beside it. Fix: score with at "
            f"most {room} RMs, or give the RMs pools of their own (reward.reward_model.enable_resource_pool=True)")


def colocate_count() -> int:
    """How many processes a bundle of verl's policy pool holds, as the config is checked (before Ray starts, no pool
    yet): ``ResourcePoolManager``'s class default (verl 0.9.1: 3, what its trainers build ``global_pool`` with; the
    touch point ``colocate-count`` says when a trainer passes its own, as verl pull request 7307 does). The replicas
    read the count verl really gave the pool (:mod:`~verl_async_rm.service.policy_pool`)."""
    from verl.single_controller.ray.base import ResourcePoolManager

    return ResourcePoolManager.max_colocate_count


def verl_v1() -> Any:
    """verl's v1 trainer package; ``ValueError`` naming verl's version and the fix where it cannot be imported (verl's
    ``neo`` branch has no v1 trainer)."""
    try:
        import verl.trainer.ppo.v1 as v1
    except ImportError as err:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("verl")
        except PackageNotFoundError:
            installed = "?"
        raise ValueError(
            f"trainer.use_v1=True, but verl {installed} cannot import its v1 trainer (verl.trainer.ppo.v1: "
            f"{type(err).__name__}: {err}). Fix: set trainer.use_v1=False: every feature of the plugin works on "
            "verl's v0 trainer (RayPPOTrainer)") from err
    return v1


def _check_reward_manager(config: Any) -> None:
    """The reward manager must resolve now, as verl's reward loop will (``resolve_reward_manager_cls``), or the run
    would fail only there."""
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    name, source = _get(config, "reward.reward_manager.name"), _get(config, "reward.reward_manager.source")
    try:
        resolve_reward_manager_cls(config)
    except Exception as exc:  # noqa: BLE001 - verl raises ValueError, AssertionError or an import error here
        if source == "importlib":
            fix = ("reward.reward_manager.module.path must name a Python file that defines the class "
                   "reward.reward_manager.name")
        else:
            from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

            fix = (f"use a registered manager ({', '.join(sorted(REWARD_MANAGER))}), or load your own "
                   "with reward.reward_manager.source=importlib")
        raise ValueError(
            f"reward.reward_manager.name={name!r} (source={source!r}) does not resolve to a reward manager: "
            f"{type(exc).__name__}: {exc}. Fix: {fix}") from exc


#: verl 0.9.1's v1 trainer modes (``trainer.v1.trainer_mode``, ``trainer/ppo/v1/__init__.py``); all work with the
#: plugin: the step boundaries come from the fit loop every mode shares
#: (:mod:`~verl_async_rm.integration.trainer_hooks`).
V1_TRAINER_MODES = ("sync", "colocate_async", "separate_async")


def check_v1_trainer(config: Any, on_error: str) -> str:
    """``trainer.v1.trainer_mode``, checked against what ``on_error`` needs: ``drop`` with the ``sync`` mode needs
    ``sync_refill_failed_groups=True`` (verl's sync replay buffer stops the run when every trajectory of a group
    failed and refilling is off). A mode verl 0.9.1 does not ship is logged."""
    mode = str(_get(config, "trainer.v1.trainer_mode") or "sync")
    if mode not in V1_TRAINER_MODES:
        logger.warning(
            "verl_async_rm: trainer.v1.trainer_mode=%s is not one of verl 0.9.1's modes %s; the async_rm/* metrics "
            "and on_error reach verl only if its trainer keeps PPOTrainer.step and PPOTrainer._validate",
            mode, ", ".join(V1_TRAINER_MODES))
    if on_error == "drop" and mode == "sync" and not _get(config, "trainer.v1.sampler.sync_refill_failed_groups"):
        raise ValueError(
            "async_rm.on_error=drop with trainer.v1.trainer_mode=sync needs "
            "trainer.v1.sampler.sync_refill_failed_groups=True: a dropped trajectory's group takes verl's failure "
            "path, and verl's sync replay buffer stops the run when every trajectory of a group failed unless it may "
            "refill the group. Fix: add trainer.v1.sampler.sync_refill_failed_groups=True (verl then fetches one "
            "prompt per dataloader call), or keep +async_rm.on_error=raise")
    return mode


#: The remote RMs this process has probed (their settings): one probe each, however often the config is checked.
_PROBED: set[Any] = set()


def probe_endpoints(settings: AsyncRMConfig) -> None:
    """Each remote RM's endpoints asked for their models and one request of the kind's API (``ValueError`` naming the
    RM, the URL and the fix), once per process, run where verl checks its config before anything starts (in a thread
    of its own: verl may call it where an event loop runs); a remote RM's service then only looks up its model."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from verl_async_rm.remote.slots import probe

    for entry in (e for e in settings.models if e.rm.remote and e.rm not in _PROBED):
        with ThreadPoolExecutor(1) as pool:
            try:
                pool.submit(asyncio.run, probe(entry.rm)).result()
            except ValueError as err:
                raise ValueError(f"RM {entry.name!r} ({entry.key}.endpoint): {err}") from err.__cause__
        _PROBED.add(entry.rm)


def _refuse_lone_validation_responses(config: Any, settings: AsyncRMConfig) -> None:
    """A pairwise judge compares the responses of a group: validation's groups of one (verl's default
    ``val_kwargs.n=1``) have nothing to compare, so every validation trajectory would fail."""
    pairwise = [e for e in settings.models if e.rm.reward_kind == "pairwise_judge"]
    validates = _get(config, "trainer.val_before_train") or (_get(config, "trainer.test_freq") or -1) > 0
    n = _get(config, "actor_rollout_ref.rollout.val_kwargs.n") or 1
    if pairwise and validates and n < 2:
        raise ValueError(
            f"{pairwise[0].key} is a pairwise judge (reward_kind=pairwise_judge) and the validation's groups hold "
            f"actor_rollout_ref.rollout.val_kwargs.n={n} response: a response alone has nothing to be compared with, "
            "so every validation trajectory would fail. Fix: actor_rollout_ref.rollout.val_kwargs.n=2 or more (with "
            "val_kwargs.do_sample=True, or greedy copies compare as ties), or no validation "
            "(trainer.val_before_train=False trainer.test_freq=-1)")


#: A Hugging Face Hub id (``owner/name``): verl downloads one for the policy, the RM replicas load local directories.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _refuse_hub_ids(config: Any, entry: Any) -> None:
    """The RM's and the policy tokenizer's paths are local directories on every node; a Hub id (not a directory here)
    is refused now, naming the key it came from, instead of failing as the replicas load."""
    rm = entry.rm
    paths = [(f"{entry.key}.model_path", rm.model_path, "the RM")] if rm.model_path else []
    if rm.retemplate != "never" and rm.policy_tokenizer_path:
        key = next(k for k in (f"{CONFIG_GROUP}.policy_tokenizer_path", "actor_rollout_ref.model.tokenizer_path",
                               "actor_rollout_ref.model.path") if _get(config, k) is not None)
        paths.append((key, rm.policy_tokenizer_path, "the policy's tokenizer (the RM reads responses decoded by it)"))
    for key, path, what in paths:
        if not os.path.isdir(path) and not os.path.isabs(path) and _HUB_ID.match(path):
            name = path.rsplit("/", 1)[-1]
            fix = (f"point {key} at that directory" if key.endswith("model_path") else
                   f"add +{CONFIG_GROUP}.policy_tokenizer_path=/shared/{name} (verl may keep the Hub id)")
            raise ValueError(
                f"{key}={path!r} is not a directory here and reads as a Hugging Face Hub id, but the RM replicas load "
                f"{what} from a local directory on every node of the reward pool. Fix: download it (hf download {path} "
                f"--local-dir /shared/{name}) and {fix}")


#: verl's advantage estimators that read only the sum of a trajectory's token rewards (``token_level_rewards.sum(-1)``
#: in verl/trainer/ppo/core_algos.py); the others (gae, reinforce_plus_plus, remax, ...) read each token's reward.
SUM_ONLY_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "gdpo", "rloo", "rloo_vectorized", "opo", "gpg",
                       "reinforce_plus_plus_baseline")


def _refuse_column_clashes(config: Any, settings: AsyncRMConfig) -> None:
    """A dataset column named like a key the plugin writes into ``reward_extra_info`` (verl's v0 trainer would fail
    joining the rollout to the batch, after the first rollout) or like one it adds to ``extra_info`` (the dataset's
    value would be lost): refused now, for the local parquet files of ``data.train_files`` / ``data.val_files``."""
    from verl_async_rm.integration.token_rewards import TOKEN_REWARDS_KEY
    from verl_async_rm.reward_mix import RM_SCORE_KEY, RM_SCORES_KEY

    ours = set(settings.mix.extra_keys(flag_drops=settings.integration.on_error == "drop"))
    if settings.mix.token_level:
        ours.add(TOKEN_REWARDS_KEY)
    for key in ("data.train_files", "data.val_files"):
        files = _get(config, key)
        for path in map(str, [files] if isinstance(files, str) else list(files or ())):
            if not path.endswith(".parquet") or not os.path.isfile(path):  # only local parquet files are read
                continue
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = pq.read_schema(path)
            extra = schema.field("extra_info").type if "extra_info" in schema.names else None
            extra_info = {f.name for f in extra} if extra is not None and pa.types.is_struct(extra) else set()
            for clash, where in ((ours & set(schema.names), "reward_extra_info"),
                                 ({RM_SCORE_KEY, RM_SCORES_KEY} & extra_info, "extra_info")):
                if clash:
                    raise ValueError(
                        f"{key}: {path} has {'extra_info field' if where == 'extra_info' else 'column'}(s) "
                        f"{sorted(clash)}, named like the key(s) the plugin writes into each trajectory's {where}: one "
                        "would overwrite the other. Fix: rename them in your dataset")
