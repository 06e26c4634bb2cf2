"""One RM replica: a verl ``Worker`` holding a full copy of the RM, rank 0 of a sharded one (:mod:`.ranks`), or a
vLLM engine tensor parallel over the replica's whole bundle (its ranks: processes of this one). The service calls it
by its actor handle; ``score`` returns one score or error per request."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from verl_async_rm.errors import EngineDeadError, RewardModelError
from verl_async_rm.scoring.colocation import check_colocated_memory
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.request import RMRequest, ScoreResult
from verl_async_rm.scoring.scorer import RewardModelScorer, ScorerStats
from verl_async_rm.scoring.sharding import check_replica_memory
from verl_async_rm.service.ranks import Ranks, end_replica

logger = logging.getLogger(__name__)

__all__ = ["RMReplica"]


class RMReplica(Worker):
    """One replica of the reward pool's worker group; :meth:`init_model` loads the RM (so replicas load in
    parallel)."""

    def __init__(self, config: RMConfig) -> None:
        super().__init__()
        self.config = config
        self._scorer: RewardModelScorer | None = None
        #: The other ranks of a sharded replica (``gpus_per_replica > 1``); this worker is rank 0.
        self._ranks: Ranks | None = None

    def init_model(self, placement: tuple[Any, int] | None = None) -> dict[str, Any]:
        """Load the RM on this replica's device, or sharded over its bundle's GPUs (``placement``: placement group,
        bundle); returns :meth:`describe`. ``ValueError`` when the weights cannot fit, naming what fits."""
        if self._scorer is not None:
            return self.describe()
        if self.config.use_gpu and torch.cuda.is_available():  # the RM's size against its GPU (none on CPU)
            device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            check_replica_memory(self.config, device_bytes)
            if self.config.placement == "policy_pool":
                check_colocated_memory(self.config, device_bytes)
        if self.config.gpus_per_replica == 1 or self.config.on_vllm:  # vLLM: one tensor-parallel engine here
            self._scorer = RewardModelScorer(self.config)
            return self.describe()
        assert placement is not None, "a sharded RM replica needs its bundle: init_model(placement=(pg, bundle))"
        self._ranks = Ranks(self.config, placement, ray.get_runtime_context().get_actor_name())
        self._scorer = self._ranks.start(lambda group, store: RewardModelScorer(self.config, shard=group, store=store))
        return self.describe()

    def score(self, requests: list[RMRequest]) -> list[ScoreResult]:
        """One entry per request: its score, or the exception that kept that request from being scored."""
        scorer = self._require_scorer()
        if scorer.asleep:  # the RM service holds batches while its replicas sleep: this is a stray call
            logger.warning("RM replica %s got a batch while asleep; waking it first", self.rank)
            scorer.wake()
        try:
            if self._ranks is None:
                return scorer.score(requests)
            return self._ranks.run(requests, lambda: scorer.score(requests))
        except EngineDeadError as err:  # no row is at fault: end the replica, the service re-queues and replaces it
            end_replica(str(err))

    def sleep(self) -> dict[str, float]:
        """Release the device's memory (weights to host memory): ``{"bytes", "seconds"}`` moved."""
        move = self._require_scorer().sleep()
        return {"bytes": float(move.bytes), "seconds": move.seconds}

    def wake(self) -> dict[str, float]:
        """Weights back on the device: ``{"bytes", "seconds"}`` moved (0 when it was awake)."""
        move = self._require_scorer().wake()
        return {"bytes": float(move.bytes), "seconds": move.seconds}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # also ``rm_wg.describe()``: every replica's, in rank order
    def describe(self) -> dict[str, Any]:
        """Where this replica runs (node, process) and what it serves (device, dtype, retemplating, max_length,
        ``engine`` and ``engine_reason``: transformers or vLLM and why, and ``packing``: whether its forwards are
        packed, with which kernel, and why)."""
        context = ray.get_runtime_context()
        info: dict[str, Any] = {
            "rank": self.rank, "world_size": self.world_size, "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "actor_name": context.get_actor_name(),
            "placement_group_id": context.get_placement_group_id(), "pid": os.getpid(),
            "model_path": self.config.model_path, "loaded": self._scorer is not None,
            "placement": self.config.placement, "gpus_per_replica": self.config.gpus_per_replica}
        if self._scorer is not None:  # device, dtype, retemplate, max_length, num_labels, engine, packing
            info.update(self._scorer.describe(), asleep=self._scorer.asleep)
        if self._ranks is not None:
            info["ranks"] = self._ranks.infos  # ranks 1..k-1: pid, actor_name, node_ip, device
        return info

    def pop_step_stats(self) -> ScorerStats:
        """Counters since the previous call; call once per training step (logs the truncation count once)."""
        return self._require_scorer().pop_step_stats()

    def _require_scorer(self) -> RewardModelScorer:
        if self._scorer is None:
            raise RewardModelError("the RM worker has no model yet: call init_model() first")
        return self._scorer
