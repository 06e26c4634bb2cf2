"""verl's own v1 trainer, built and run in this process exactly as verl's ``TaskRunnerV1.run`` builds and runs it, with
each step's batch recorded for tests (the trainer-level tests run it on CPU, :mod:`verl_async_rm.cpu_platform`).

``python -m verl.trainer.main_ppo`` runs ``TaskRunnerV1.run`` in a Ray actor: TransferQueue, the trainer class of
``trainer.v1.trainer_mode`` (``get_trainer_cls``), ``trainer.init()`` (verl's worker groups, its vLLM rollout
replicas, checkpoint engine and reward loop), the agent-loop manager (``TaskRunnerV1.init_agent_loop_manager``: the
plugin's when the config names it), then ``trainer.fit``. :class:`TrainerRun` calls those same methods, of verl's own
``TaskRunnerV1`` class, in the caller's process, so a test can reach the trainer and the manager. What it adds only
observes:

- :attr:`TrainerRun.steps`: each training step's trajectories as verl's fit loop holds them in TransferQueue just
  before it logs and clears them (``PPOTrainer._compute_metrics`` is wrapped on the instance to read them first):
  rewards (``rm_scores``), GRPO advantages, the actor's log-probs before the update, responses,
  ``reward_extra_info``, and the step's metrics;
- :meth:`TrainerRun.before`: run a callable before a trainer method (e.g. ``_update_actor``), to look at the cluster
  at that moment, on the instance only.

:func:`init_ray` starts Ray as verl's ``run_ppo`` does (its runtime env, ``ray_kwargs.ray_init``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RECORDED_FIELDS", "StepRecord", "TrainerRun", "init_ray"]

#: What :class:`TrainerRun` reads from TransferQueue for each step, beside the keys.
RECORDED_FIELDS = ("prompts", "responses", "response_mask", "rm_scores", "advantages", "old_log_probs", "extra_fields",
                   "raw_prompt")


@dataclass
class StepRecord:
    """One training step as verl's fit loop had it, in the order of its batch (trajectory keys
    ``{uid}_{session}_{index}``)."""

    step: int
    keys: list[str]
    prompts: list[list[int]]
    responses: list[list[int]]
    raw_prompts: list[list[dict[str, Any]]]
    rewards: list[float]  # rm_scores summed over the response (verl's token-level reward on the last token)
    advantages: list[list[float]]  # per response token (GRPO: the same value on every token of a response)
    old_log_probs: list[list[float]]  # the actor's log-probs of the response tokens before this step's update
    extra_infos: list[dict[str, Any]]  # reward_extra_info
    metrics: dict[str, Any] = field(default_factory=dict)

    def groups(self) -> dict[str, list[int]]:
        """Positions of each prompt's trajectories (GRPO groups), by prompt uid."""
        out: dict[str, list[int]] = {}
        for i, key in enumerate(self.keys):
            out.setdefault(key.split("_")[0], []).append(i)
        return out


def init_ray(config: Any, env_vars: Mapping[str, str] | None = None, namespace: str | None = None) -> None:
    """``ray.init`` as verl's ``run_ppo`` does it: verl's PPO runtime env (with ``TRANSFER_QUEUE_ENABLE``) merged with
    ``ray_kwargs.ray_init``, plus ``env_vars`` for every worker."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    runtime_env = get_ppo_ray_runtime_env(config)
    runtime_env.setdefault("env_vars", {})["TRANSFER_QUEUE_ENABLE"] = "1"
    runtime_env["env_vars"].update(env_vars or {})
    kwargs = OmegaConf.to_container(config.ray_kwargs.get("ray_init", {}), resolve=True)
    user_env = kwargs.pop("runtime_env", None) or {}
    kwargs["runtime_env"] = OmegaConf.to_container(OmegaConf.merge(runtime_env, user_env))
    ray.init(namespace=namespace, **kwargs)


class TrainerRun:
    """verl's trainer and agent-loop manager for ``config``, built as ``TaskRunnerV1.run`` builds them (module doc).

    ``start()`` builds them (Ray must be up, :func:`init_ray`); ``fit()`` runs verl's fit loop to
    ``trainer.total_training_steps`` (raising what it raises); ``close()`` shuts the manager and TransferQueue down.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.steps: list[StepRecord] = []
        self.runner: Any = None

    @property
    def trainer(self) -> Any:
        return self.runner.trainer

    @property
    def manager(self) -> Any:
        return self.runner.agent_loop_manager

    def start(self) -> TrainerRun:
        import transfer_queue as tq
        from omegaconf import OmegaConf
        from verl.trainer.main_ppo import TaskRunnerV1
        from verl.trainer.ppo.v1 import get_trainer_cls

        config = self.config
        config.transfer_queue.enable = True
        OmegaConf.resolve(config)
        self.runner = TaskRunnerV1.__ray_actor_class__()
        self.runner.config = config
        tq.init(config.transfer_queue)
        try:
            self.runner.trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)
            self.runner.trainer.init()
            self._record_steps()
            self.runner.init_agent_loop_manager()
        except BaseException:
            tq.close()
            raise
        return self

    def fit(self) -> None:
        self.trainer.fit(self.manager)

    def before(self, method: str, fn: Callable[[], None], target: Any = None) -> None:
        """Call ``fn()`` before each call of ``target.method`` (``target``: the trainer by default)."""
        target = self.trainer if target is None else target
        original = getattr(target, method)

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            fn()
            return original(*args, **kwargs)

        setattr(target, method, wrapped)

    def close(self) -> None:
        import transfer_queue as tq

        manager = getattr(self.runner, "agent_loop_manager", None)
        try:
            if manager is not None and hasattr(manager, "shutdown"):
                manager.shutdown()
        finally:
            tq.close()

    def _record_steps(self) -> None:
        trainer = self.trainer
        original = trainer._compute_metrics

        @functools.wraps(original)
        def compute_metrics(batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
            record = _read_step(batch, global_steps)
            result = original(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
            record.metrics = dict(metrics)
            self.steps.append(record)
            return result

        trainer._compute_metrics = compute_metrics


def _read_step(batch: Any, step: int) -> StepRecord:
    import transfer_queue as tq

    keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
    keys = [batch.keys[i] for i in keep]
    data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=list(RECORDED_FIELDS))
    mask = data["response_mask"]
    raw = list(data["raw_prompt"])
    return StepRecord(
        step=step, keys=keys,
        prompts=[data["prompts"][i].tolist() for i in range(len(keys))],
        responses=[data["responses"][i].tolist() for i in range(len(keys))],
        raw_prompts=[list(getattr(r, "data", r)) for r in raw],
        rewards=[float(data["rm_scores"][i].sum()) for i in range(len(keys))],
        advantages=[data["advantages"][i][mask[i].bool()].tolist() for i in range(len(keys))],
        old_log_probs=[data["old_log_probs"][i][mask[i].bool()].tolist() for i in range(len(keys))],
        extra_infos=[dict(data["extra_fields"][i].get("reward_extra_info", {})) for i in range(len(keys))],
    )
