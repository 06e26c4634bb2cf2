"""The ways the demo runs a step on verl's v1 trainer, on the same prompts, rollout, RM and mix.

Every mode goes through :class:`~verl_async_rm.testing.V1FitLoop`, verl's own v1 fit loop without the policy's GPU
work: the prompts are tagged in TransferQueue and dispatched (``PPOTrainer._submit_batch_to_rollout``), verl's replay
buffer waits for every group (both loops poll TransferQueue every :data:`POLL_INTERVAL_S`), the sampled trajectories
are read from TransferQueue and cleared, and the step is closed.

- ``async``: the plugin's :class:`~verl_async_rm.AsyncRMAgentLoopManagerV1`: each trajectory goes to the RM executor
  the moment its agent loop ends, and verl's reward loop mixes RM and rule scores before the trajectory is put in
  TransferQueue, so every reward is known when the sample returns; the step ends there.
- ``async_vllm``: the same, with the plugin's replicas scoring on vLLM's pooling engine (``+async_rm.engine=vllm``;
  verl's vLLM rollout only).
- ``sync``: verl's plain ``AgentLoopManagerTQ`` with no reward-loop workers (what verl's v1 trainer does with a
  colocated RM: ``_compute_reward_colocate`` after sampling); once the sample returns, its prompts and responses are
  read from TransferQueue, split across the same RM replicas (contiguous chunks, as verl's ``DP_COMPUTE_PROTO``
  dispatch does for a colocated RM) and scored, then the rule score and the same mix are applied; the step ends when
  the last reward is known.
- ``verl_served``: verl's plain ``AgentLoopManagerTQ`` given the reward-loop workers of verl's own vLLM-served RM on
  a pool of its own (``reward.reward_model.enable=True``, ``enable_resource_pool=True``;
  :mod:`verl_async_rm.demo.served_rm`): each trajectory is scored by one ``/classify`` request as its agent loop ends.
  verl's served path gives the raw RM score (a rule needs a custom reward function that calls the RM itself), so the
  demo applies the same rule and mix to it afterwards, as in ``sync``.

Trajectory finish times come from the demo's agent loop (``extra_fields["demo_finished_at"]``), in every mode.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from verl_async_rm.demo.agent_loop import FINISHED_AT
from verl_async_rm.demo.timeline import BatchRecord, StepTimeline
from verl_async_rm.request import RMRequest

logger = logging.getLogger(__name__)

__all__ = [
    "ASYNC_FIELDS",
    "POLL_INTERVAL_S",
    "SERVED_FIELDS",
    "SYNC_FIELDS",
    "collect_batches",
    "fit_loop",
    "requests_from_batch",
    "rule_scorer",
    "run_async_step",
    "run_served_step",
    "run_sync_step",
    "sampled_order",
    "score_after_rollout",
]

#: Longest a control call (records, reset) to a replica, a reward-loop worker or the generation server may take.
CONTROL_TIMEOUT_S = 60.0
#: The replay buffer's TransferQueue polling period, the same in every mode (verl's default is 2 s; a CPU step of a
#: few seconds needs a shorter one). A step's end is seen up to one period late, in either mode.
POLL_INTERVAL_S = 0.05
#: What each mode reads from TransferQueue for the sampled trajectories.
ASYNC_FIELDS = ("rm_scores", "extra_fields", "responses")
SYNC_FIELDS = ("prompts", "responses", "raw_prompt", "data_source", "reward_model", "extra_fields")
SERVED_FIELDS = ("rm_scores", "extra_fields", "responses", "data_source", "reward_model")


def fit_loop(config: Any, manager: Any) -> Any:
    """verl's v1 fit loop for one mode: the demo's polling period, no refill (the modes compare the same prompts)."""
    from verl_async_rm.testing.v1 import V1FitLoop

    return V1FitLoop(config, manager, make_prompts=_no_refill, poll_interval_s=POLL_INTERVAL_S)


def _no_refill(num_prompts: int) -> Any:
    """verl's replay buffer refills failed groups with new prompts; the demo's steps must be the same in every mode."""
    raise RuntimeError(
        f"{num_prompts} prompt group(s) of the demo step failed in the agent loop (see the Ray worker logs); the demo "
        "compares the same prompts in every mode, so it does not refill them"
    )


def collect_batches(service: Any) -> list[BatchRecord]:
    """Pop the RM replicas' scoring-call records (``RMService.pop_batch_records``)."""
    per_replica = ray.get(service.pop_batch_records.remote(), timeout=CONTROL_TIMEOUT_S)
    return [
        BatchRecord(replica=i, start=r["start"], end=r["end"], size=int(r["size"]))
        for i, records in enumerate(per_replica)
        for r in records
    ]


def collect_rm_calls(workers: Sequence[Any]) -> list[tuple[float, float]]:
    """Pop the served-RM requests verl's reward-loop workers recorded (``TimedRewardLoopWorker.pop_calls``)."""
    per_worker = ray.get([w.pop_calls.remote() for w in workers], timeout=CONTROL_TIMEOUT_S)
    return [tuple(call) for calls in per_worker for call in calls]


def _begin(reset: Callable[[], None] | None, service: Any = None, workers: Sequence[Any] = ()) -> None:
    """Reset the rollout (the stand-in server's repeat counts) and forget records left from earlier calls."""
    if reset is not None:
        reset()
    if service is not None:
        collect_batches(service)
    if workers:
        collect_rm_calls(workers)


def _finishes(data: Any, order: Sequence[int]) -> list[float]:
    """When each trajectory's generation ended, as the demo's agent loop recorded it."""
    return [float(_row(data, "extra_fields", i)[FINISHED_AT]) for i in order]


def _digests(data: Any, order: Sequence[int]) -> list[str]:
    """A short digest of each trajectory's response token ids (the modes' scores compare where they are equal)."""
    return [hashlib.sha1(repr(data["responses"][i].tolist()).encode()).hexdigest()[:12] for i in order]


def sampled_order(keys: Sequence[str], uids: Sequence[str]) -> list[int]:
    """Positions of the sampled trajectories (keys ``{uid}_{session}_{index}``) sorted by prompt order, then session.

    verl's replay buffer returns the step's trajectories in the order TransferQueue lists them (when they finished);
    the demo reports them in prompt order, so every mode lists the same trajectory at the same place. Raises when a
    prompt has no trajectory or a key belongs to no prompt of the step.
    """
    rank = {uid: i for i, uid in enumerate(uids)}
    parsed = []
    for pos, key in enumerate(keys):
        uid, _, rest = str(key).partition("_")
        if uid not in rank:
            raise RuntimeError(f"sampled trajectory {key!r} belongs to no prompt of this step")
        parsed.append((rank[uid], tuple(int(p) for p in rest.split("_") if p.isdigit()), pos))
    missing = set(rank) - {str(k).partition("_")[0] for k in keys}
    if missing:
        raise RuntimeError(f"{len(missing)} prompt(s) of this step have no sampled trajectory: {sorted(missing)[:3]}")
    return [pos for *_, pos in sorted(parsed)]


def run_async_step(loop: Any, manager: Any, prompts: Any, step: int,
                   reset: Callable[[], None] | None = None, mode: str = "async") -> StepTimeline:
    """One step through the plugin's v1 manager; rewards are read from verl's ``rm_scores`` in TransferQueue.
    ``mode``: ``async`` (replicas on transformers) or ``async_vllm`` (``+async_rm.engine=vllm``)."""
    service = manager.rm_service
    _begin(reset, service)
    uids = list(prompts["uid"])
    t0 = time.time()
    batch = loop.train_step(prompts, fields=ASYNC_FIELDS)
    sampled_at = batch.sampled_at
    returned = time.time()
    order = sampled_order(batch.keys, uids)
    infos = [batch.reward_extra_info(i) for i in order]
    metrics = batch.metrics
    return StepTimeline(
        mode=mode, step=step, t0=t0, t_end=sampled_at, finishes=_finishes(batch.data, order),
        batches=collect_batches(service), num_replicas=manager.async_rm_config.rm.num_replicas,
        responses=_digests(batch.data, order),
        rewards=[batch.reward(i) for i in order],
        rm_scores=[float(info["rm_score"]) for info in infos],
        rule_scores=[float(info["rule_score"]) for info in infos],
        extra={
            "sample_s": sampled_at - t0,
            "after_sample_s": returned - sampled_at,
            "executor_reward_tail_s": metrics.get("async_rm/reward_tail_s"),
            "executor_rm_utilization": metrics.get("async_rm/rm_utilization"),
            "errors": metrics.get("async_rm/errors"),
        },
    )


def requests_from_batch(data: Any, order: Sequence[int], keys: Sequence[str]) -> list[RMRequest]:
    """One :class:`RMRequest` per sampled trajectory, in ``order``, from the fields read from TransferQueue.

    ``prompts`` and ``responses`` are jagged (one unpadded row per trajectory, as the agent loop put them), so the
    rows are the token ids the plugin's workers send for the same trajectory; ``raw_prompt`` comes back as a
    non-tensor stack (``list(...)`` gives one message list per trajectory, as in verl's ``_compute_reward_colocate``).
    """
    raw = list(data["raw_prompt"])
    return [
        RMRequest(uid=str(keys[i]), prompt_ids=data["prompts"][i].tolist(),
                  response_ids=data["responses"][i].tolist(), raw_prompt=raw[i],
                  group=str(keys[i]).partition("_")[0])  # verl's prompt uid, as the plugin's workers set it
        for i in order
    ]


def score_after_rollout(service: Any, requests: list[RMRequest], timeout_s: float) -> list[float]:
    """Score the whole batch at once through the RM service: announced first, so it leaves the moment the last request
    arrives, split evenly over the replicas (``max_batch_size`` each at most); raises the first failure. The step's
    figures are then dropped (``end_step``): they are not the async mode's."""
    ray.get(service.drain_after.remote(len(requests)), timeout=CONTROL_TIMEOUT_S)
    scores = ray.get([service.score.remote(r, deadline_s=timeout_s) for r in requests],
                     timeout=timeout_s + CONTROL_TIMEOUT_S)
    ray.get(service.end_step.remote(), timeout=CONTROL_TIMEOUT_S)
    return [float(s) for s in scores]


def rule_scorer(tokenizer: Any) -> Callable[[Any, int], float]:
    """Trajectory ``i``'s rule score from the fields read from TransferQueue, as verl's reward manager computes it.

    ``NaiveRewardManager`` decodes the response with ``skip_special_tokens=True`` and calls the rule with the
    trajectory's ``data_source`` and ``reward_model["ground_truth"]``.
    """
    from verl_async_rm.demo import rule

    def score(data: Any, i: int) -> float:
        text = tokenizer.decode(data["responses"][i].tolist(), skip_special_tokens=True)
        ground_truth = _row(data, "reward_model", i)["ground_truth"]
        return float(rule.compute_score(_row(data, "data_source", i), text, ground_truth)["score"])

    return score


def _row(data: Any, key: str, i: int) -> Any:
    """Row ``i`` of a non-tensor field read from TransferQueue (a stack of ``NonTensorData`` or a plain list)."""
    value = data[key][i]
    return getattr(value, "data", value)


def run_sync_step(
    loop: Any,
    service: Any,
    num_replicas: int,
    prompts: Any,
    step: int,
    *,
    rule_score: Callable[[Any, int], float],
    mix: Any,
    timeout_s: float,
    reset: Callable[[], None] | None = None,
) -> StepTimeline:
    """One step the synchronous way: rollout with no scoring, then the whole batch on the RM replicas, then the mix.

    ``rule_score(data, i)`` gives trajectory ``i``'s rule score (:func:`rule_scorer`); ``mix`` is the plugin's
    ``RewardMix``.
    """
    _begin(reset, service)
    uids = list(prompts["uid"])
    t0 = time.time()
    batch = loop.train_step(prompts, fields=SYNC_FIELDS)
    sampled_at = batch.sampled_at
    read = time.time()
    order = sampled_order(batch.keys, uids)
    rm_scores = score_after_rollout(service, requests_from_batch(batch.data, order, batch.keys), timeout_s)
    rule_scores = [rule_score(batch.data, i) for i in order] if mix.uses_rule else [0.0] * len(order)
    rewards = [mix.combine(rm, rule) for rm, rule in zip(rm_scores, rule_scores, strict=True)]
    t_end = time.time()
    return StepTimeline(
        mode="sync", step=step, t0=t0, t_end=t_end, finishes=_finishes(batch.data, order),
        batches=collect_batches(service), num_replicas=num_replicas, responses=_digests(batch.data, order),
        rewards=rewards, rm_scores=rm_scores, rule_scores=rule_scores,
        extra={"sample_s": sampled_at - t0, "after_sample_s": read - sampled_at, "executor_reward_tail_s": None,
               "executor_rm_utilization": None, "errors": 0},
    )


def run_served_step(
    loop: Any,
    workers: Sequence[Any],
    num_replicas: int,
    prompts: Any,
    step: int,
    *,
    rule_score: Callable[[Any, int], float],
    mix: Any,
    reset: Callable[[], None] | None = None,
) -> StepTimeline:
    """One step through verl's plain manager with verl's own vLLM-served RM (see module doc).

    ``workers`` are the served RM's reward-loop workers (``TimedRewardLoopWorker``): their request records give the
    RM's busy time and the step's last score. The step ends when verl's replay buffer returns the sample, as in
    ``async``; the rule and the mix are applied to the raw RM scores afterwards (not timed: a rule is cheap).
    """
    _begin(reset, None, workers)
    uids = list(prompts["uid"])
    t0 = time.time()
    batch = loop.train_step(prompts, fields=SERVED_FIELDS)
    sampled_at = batch.sampled_at
    order = sampled_order(batch.keys, uids)
    rm_scores = [batch.reward(i) for i in order]  # verl's served RM: the reward is the raw RM score
    rule_scores = [rule_score(batch.data, i) for i in order] if mix.uses_rule else [0.0] * len(order)
    return StepTimeline(
        mode="verl_served", step=step, t0=t0, t_end=sampled_at, finishes=_finishes(batch.data, order), batches=[],
        num_replicas=num_replicas, responses=_digests(batch.data, order), rm_calls=collect_rm_calls(workers),
        rewards=[mix.combine(rm, rule) for rm, rule in zip(rm_scores, rule_scores, strict=True)],
        rm_scores=rm_scores, rule_scores=rule_scores,
        extra={"sample_s": sampled_at - t0, "after_sample_s": time.time() - sampled_at,
               "executor_reward_tail_s": None, "executor_rm_utilization": None, "errors": 0},
    )
