"""The two ways the demo runs a step, on the same prompts, generation server, RM replicas and reward mix.

- ``async``: verl's agent loop through :class:`~verl_async_rm.AsyncRMAgentLoopManager` (v0 trainer path): each
  trajectory goes to the RM executor the moment its agent loop ends; verl's reward loop mixes RM and rule scores.
- ``sync``: verl's plain ``AgentLoopManager`` with no per-trajectory scoring; once the whole batch is back, it is
  split across the same RM replicas (contiguous chunks, as verl's ``DP_COMPUTE_PROTO`` dispatch does for a colocated
  RM) and scored, then the rule score and the same mix are applied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from verl_async_rm.demo.timeline import BatchRecord, StepTimeline
from verl_async_rm.rm.request import RMRequest

logger = logging.getLogger(__name__)

__all__ = ["collect_batches", "requests_from_output", "run_async_step", "run_sync_step"]

#: Longest a control call (records, reset) to a replica or the generation server may take.
CONTROL_TIMEOUT_S = 60.0


def collect_batches(replicas: Sequence[Any]) -> list[BatchRecord]:
    """Pop every replica's scoring-call records (``RewardModelWorker.pop_batch_records``)."""
    per_replica = ray.get([w.pop_batch_records.remote() for w in replicas], timeout=CONTROL_TIMEOUT_S)
    return [
        BatchRecord(replica=i, start=r["start"], end=r["end"], size=int(r["size"]))
        for i, records in enumerate(per_replica)
        for r in records
    ]


def _begin(server: Any, replicas: Sequence[Any]) -> None:
    """Same lengths for the same prompts in both modes; forget records left from earlier calls."""
    ray.get(server.reset.remote(), timeout=CONTROL_TIMEOUT_S)
    collect_batches(replicas)


def _finishes(server: Any) -> list[float]:
    return [r["end"] for r in ray.get(server.pop_finished.remote(), timeout=CONTROL_TIMEOUT_S)]


def _column(output: Any, key: str) -> list[float]:
    values = output.non_tensor_batch.get(key)
    return [] if values is None else [float(v) for v in values]


def run_async_step(manager: Any, server: Any, prompts: Any, step: int) -> StepTimeline:
    """One step through the plugin's manager; rewards are read from verl's ``rm_scores``."""
    replicas = list(manager.replicas)  # current handles (a lost replica is replaced)
    _begin(server, replicas)
    t0 = time.time()
    output = manager.generate_sequences(prompts)
    t_end = time.time()
    timing = output.meta_info.get("timing", {})
    return _timeline(
        "async", step, t0, t_end, server, replicas,
        rewards=[float(v) for v in output.batch["rm_scores"].sum(dim=-1).tolist()],
        rm_scores=_column(output, "rm_score"),
        rule_scores=_column(output, "rule_score"),
        extra={
            "executor_reward_tail_s": timing.get("async_rm/reward_tail_s"),
            "executor_rm_utilization": timing.get("async_rm/rm_utilization"),
            "errors": timing.get("async_rm/errors"),
        },
    )


def _timeline(mode: str, step: int, t0: float, t_end: float, server: Any, replicas: Sequence[Any],
              **scores: Any) -> StepTimeline:
    """The step's record: its times, the finishes the server saw and the batches the replicas ran."""
    return StepTimeline(mode=mode, step=step, t0=t0, t_end=t_end, finishes=_finishes(server),
                        batches=collect_batches(replicas), num_replicas=len(replicas), **scores)


def requests_from_output(output: Any) -> list[RMRequest]:
    """One :class:`RMRequest` per row of a v0 agent-loop output (padding removed with the attention mask)."""
    prompts, responses = output.batch["prompts"], output.batch["responses"]
    mask = output.batch["attention_mask"].bool()
    width = prompts.shape[1]
    raw = output.non_tensor_batch.get("raw_prompt")
    return [
        RMRequest(
            uid=str(output.non_tensor_batch["uid"][i]) if "uid" in output.non_tensor_batch else str(i),
            prompt_ids=prompts[i][mask[i, :width]].tolist(),
            response_ids=responses[i][mask[i, width:]].tolist(),
            raw_prompt=None if raw is None else raw[i],
        )
        for i in range(len(output))
    ]


def score_after_rollout(replicas: Sequence[Any], requests: list[RMRequest], timeout_s: float) -> list[float]:
    """Split ``requests`` in contiguous chunks over the replicas, score them, raise if any item failed."""
    n = len(replicas)
    bounds = [round(k * len(requests) / n) for k in range(n + 1)]
    chunks = [requests[bounds[k]: bounds[k + 1]] for k in range(n)]
    refs = [(w.score.remote(chunk) if chunk else None) for w, chunk in zip(replicas, chunks, strict=True)]
    ready = [ref for ref in refs if ref is not None]
    _, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
    if pending:
        for ref in pending:
            ray.cancel(ref)
        raise TimeoutError(f"the RM replicas did not score the batch within {timeout_s:g}s (demo step_timeout_s)")
    results = [r for ref in refs if ref is not None for r in ray.get(ref)]
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} RM scores failed; first: {failed[0]!r}")
    return [float(r) for r in results]


def run_sync_step(
    manager: Any,
    server: Any,
    replicas: Sequence[Any],
    prompts: Any,
    step: int,
    *,
    rule_score: Callable[[Any, int], float],
    mix: Any,
    timeout_s: float,
) -> StepTimeline:
    """One step the synchronous way: rollout with no scoring, then the whole batch on the RM replicas, then the mix.

    ``rule_score(output, i)`` gives row ``i``'s rule score; ``mix`` is the plugin's ``RewardMix``.
    """
    _begin(server, replicas)
    t0 = time.time()
    output = manager.generate_sequences(prompts)
    rm_scores = score_after_rollout(replicas, requests_from_output(output), timeout_s)
    rule_scores = [rule_score(output, i) for i in range(len(output))] if mix.uses_rule else [0.0] * len(output)
    rewards = [mix.combine(rm, rule) for rm, rule in zip(rm_scores, rule_scores, strict=True)]
    t_end = time.time()
    return _timeline(
        "sync", step, t0, t_end, server, replicas, rewards=rewards, rm_scores=rm_scores, rule_scores=rule_scores,
        extra={"executor_reward_tail_s": None, "executor_rm_utilization": None, "errors": 0},
    )
