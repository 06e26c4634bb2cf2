"""verl's v1 fit loop without the policy's GPU work, run with verl's own methods: for the tests that must control time
exactly and the tests of RM kinds, which drive the agent loop (the trainer-level tests run verl's real trainer:
:class:`verl_async_rm.testing.TrainerRun`).

Building verl's whole ``PPOTrainer`` (FSDP workers, vLLM replicas) costs about a minute on CPU, and its fit loop
decides when prompts are dispatched and when the step ends; the part of it that the agent-loop manager sees needs
none of that. :class:`V1FitLoop` runs it with verl's
real methods and classes, borrowed from ``PPOTrainer`` (``trainer/ppo/v1/trainer_base.py``):

- dispatch: ``PPOTrainer._submit_batch_to_rollout`` (prompt tags in TransferQueue, then
  ``agent_loop_manager.generate_sequences``), refills through ``_add_prompts_to_generate``;
- sampling: the replay buffer ``PPOTrainer._build_replay_buffer`` builds for ``trainer.v1.trainer_mode`` (it waits
  for every group, and decides what a ``failure`` group becomes: sampled with its missing trajectories left out, or
  refilled with ``trainer.v1.sampler.sync_refill_failed_groups``);
- the step's end: the plugin's hook of ``PPOTrainer.step`` (:func:`verl_async_rm.integration.trainer_hooks.closing`),
  then ``Tracking.log`` at ``global_steps`` when a tracker is given;
- the trainer's phase hooks where verl's sync trainer calls them: ``on_sample_end`` right after the sampling, and
  ``on_step_end`` after the step (verl sleeps and wakes its rollout there), wrapped as the plugin wraps a real
  trainer's (:func:`verl_async_rm.integration.trainer_hooks.hook_phases`: the RM on the policy's GPUs sleeps and wakes);
- validation: the dispatch and sampling of ``PPOTrainer._validate`` (partition ``val``, ``validate=True``), closed
  with the same hook as ``_validate``.

What it leaves out is the policy's work between sampling and the step's end (log-probs, advantages, the update),
which the plugin never touches.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["V1FitLoop", "V1Batch", "prompt_batch"]


def prompt_batch(questions: list[str], *, agent_names: list[str] | None = None, ground_truth: str = "42",
                 data_source: str = "tiny", first_index: int = 0) -> Any:
    """A v1 prompt batch (a TensorDict, as verl's dataloader and ``collate_fn`` give it) with fresh uids."""
    import torch
    from verl.utils import tensordict_utils as tu

    tensors: dict[str, Any] = {
        "uid": [uuid.uuid4().hex for _ in questions],
        "raw_prompt": [[{"role": "user", "content": q}] for q in questions],
        "data_source": [data_source] * len(questions),
        "reward_model": [{"ground_truth": ground_truth} for _ in questions],
        "index": torch.arange(first_index, first_index + len(questions)),
    }
    if agent_names is not None:
        tensors["agent_name"] = list(agent_names)
    return tu.get_tensordict(tensor_dict=tensors)


@dataclass
class V1Batch:
    """One sampled batch: the trajectory keys (``{uid}_{session}_{index}``), their data, the step's metrics, and when
    (``time.time()``) the replay buffer's sample returned, i.e. when the trainer could go on with the batch."""

    keys: list[str]
    data: Any  # TensorDict read from TransferQueue (rm_scores, extra_fields, prompts, responses, uid...)
    metrics: dict[str, Any]
    sampled_at: float

    def reward_extra_info(self, i: int) -> dict[str, Any]:
        return self.data["extra_fields"][i]["reward_extra_info"]

    def reward(self, i: int) -> float:
        return float(self.data["rm_scores"][i].sum())


class V1FitLoop:
    """Drive an agent-loop manager through verl's v1 fit loop (see module doc); ``global_steps`` counts from 1.

    Args:
        config: verl's trainer config (``trainer.use_v1=True``); TransferQueue must be initialised
            (``tq.init(config.transfer_queue)``).
        manager: the agent-loop manager (the plugin's, or verl's ``AgentLoopManagerTQ``).
        make_prompts: ``(num_prompts) -> prompt batch`` for refills; default: :func:`prompt_batch` of a fixed question.
        tracking: a verl ``Tracking`` to log each step's metrics to, as the fit loop does; optional.
        poll_interval_s: the replay buffer's polling period (verl's default is 2 s; shorter keeps CPU steps short).
    """

    def __init__(self, config: Any, manager: Any, *, make_prompts: Callable[[int], Any] | None = None,
                 tracking: Any = None, poll_interval_s: float = 0.05) -> None:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        self.config = config
        self.agent_loop_manager = manager
        self.trainer_mode = config.trainer.v1.trainer_mode
        self.global_steps = 0
        self.logger = tracking
        self._make_prompts = make_prompts or (lambda n: prompt_batch(["refill question"] * n))
        self.replay_buffer = PPOTrainer._build_replay_buffer(self)
        self.replay_buffer.poll_interval = poll_interval_s
        from verl_async_rm.integration.trainer_hooks import hook_phases

        hook_phases(self)

    def on_sample_end(self) -> None:
        """verl's trainers sleep their rollout here; this loop has none (the plugin's hook adds the RM's sleep)."""

    def on_step_end(self) -> None:
        """verl's trainers wake their rollout here (see :meth:`on_sample_end`)."""

    # verl's PPOTrainer methods that _build_replay_buffer and _submit_batch_to_rollout call on ``self``
    def _resolve_filter_groups_metric(self) -> Any:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        return PPOTrainer._resolve_filter_groups_metric(self)

    def _submit_batch_to_rollout(self, batch: Any) -> int:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        return PPOTrainer._submit_batch_to_rollout(self, batch)

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's ``refill_fn``: fresh prompts for failed (or filtered) groups."""
        return self._submit_batch_to_rollout(self._make_prompts(num_prompts))

    def dispatch(self, prompts: Any) -> None:
        """Start a training batch at the current step without waiting (async modes: a batch of a later step)."""
        self._submit_batch_to_rollout(prompts)

    def train_step(self, prompts: Any | None, batch_size: int | None = None,
                   fields: tuple[str, ...] = ("uid", "rm_scores", "extra_fields", "prompts", "responses")) -> V1Batch:
        """One training step: dispatch ``prompts`` (None: dispatched already), sample ``batch_size`` groups (default:
        ``len(prompts)``), read and clear them, close the step as the plugin's hook of ``PPOTrainer.step`` does, log.

        Raises what the step raises (verl's replay buffer; the plugin's ``RMScoreError``, ``TrajectoryDroppedError``).
        """
        import transfer_queue as tq

        from verl_async_rm.integration.trainer_hooks import closing

        self.global_steps += 1
        size = batch_size if batch_size is not None else len(prompts)

        def body() -> tuple[Any, Any, dict, float]:
            if prompts is not None:
                self.dispatch(prompts)
            meta, eviction = self.replay_buffer.sample(global_steps=self.global_steps, partition_id="train",
                                                       batch_size=size)
            sampled_at = time.time()
            self.on_sample_end()
            try:
                return meta, tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                                             select_fields=list(fields)), eviction, sampled_at
            finally:
                tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)

        (meta, data, metrics, sampled_at), extra = closing(self, "train", body)
        self.on_step_end()
        metrics = {**metrics, **extra}
        if self.logger is not None:
            self.logger.log(data=metrics, step=self.global_steps)
        return V1Batch(keys=list(meta.keys), data=data, metrics=metrics, sampled_at=sampled_at)

    def validate(self, prompts: Any,
                 fields: tuple[str, ...] = ("uid", "rm_scores", "extra_fields")) -> V1Batch:
        """A validation pass at the current step, as ``PPOTrainer._validate`` dispatches and samples it."""
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        from verl_async_rm.integration.trainer_hooks import closing

        tu.assign_non_tensor_data(prompts, "global_steps", self.global_steps)
        tu.assign_non_tensor_data(prompts, "validate", True)
        tag = {"is_prompt": True, "status": "pending", "global_steps": self.global_steps}
        tags = [dict(tag) for _ in range(len(prompts))]

        def body() -> tuple[Any, Any, float]:
            tq.kv_batch_put(keys=list(prompts["uid"]), partition_id="val", tags=tags)
            self.agent_loop_manager.generate_sequences(prompts)
            meta, _ = self.replay_buffer.sample(global_steps=self.global_steps, partition_id="val",
                                                batch_size=len(prompts))
            sampled_at = time.time()
            try:
                return meta, tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                                             select_fields=list(fields)), sampled_at
            finally:
                tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)

        (meta, data, sampled_at), metrics = closing(self, "val", body)
        if self.logger is not None:
            self.logger.log(data=metrics, step=self.global_steps)
        return V1Batch(keys=list(meta.keys), data=data, metrics=metrics, sampled_at=sampled_at)
