"""The demo's replay buffer: verl's sync ``ReplayBuffer`` polling every 50 ms
(:class:`~verl_async_rm.testing.replay_buffer.ShortPollReplayBuffer`), which also times the rollout and the reward
tail of each training step and writes its trajectories' rewards to a file, the same way in every mode.

verl's fit loop calls ``sample`` at the start of its ``gen`` phase (right after the step's prompts were dispatched)
and goes on with the batch when it returns, every reward known. The demo's agent loop records when each trajectory's
generation ended (``extra_fields["demo_finished_at"]``), so for a training batch:

- ``demo/rollout_s``: from ``sample``'s call to the last generation's end;
- ``demo/reward_tail_s``: from the last generation's end to ``sample``'s return: how long the step waited for rewards
  (and for verl's replay buffer to see them) after its rollout was done.

Both go to verl's step metrics (the sampler's metrics dict), so verl's ``Tracking`` logs them. Each trajectory's
reward (``rm_scores``), ``reward_extra_info``, response length, a digest of its prompt and response ids and its own
reward tail (``reward_wait_s``: verl's ``AgentLoopMetrics.compute_score``, from its agent loop's end to its reward)
go to ``sampler_kwargs.record_path`` (JSON lines). With another agent loop (no generation end recorded) it
records the trajectories and gives no timeline.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from verl_async_rm.demo.agent_loop import FINISHED_AT
from verl_async_rm.testing.replay_buffer import ShortPollReplayBuffer

__all__ = ["TimedReplayBuffer"]


class TimedReplayBuffer(ShortPollReplayBuffer):
    """See the module doc; ``sampler_kwargs``: ``poll_interval_s``, ``record_path``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record_path = (self.sampler_kwargs or {}).get("record_path")

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict]:
        start = time.time()
        batch, metrics = super().sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
        end = time.time()
        if partition_id != "train":
            return batch, metrics
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["extra_fields", "rm_scores", "prompts", "responses", "metrics"])
        extras = [data["extra_fields"][i] for i in range(len(batch.keys))]
        ends = [e.get(FINISHED_AT) for e in extras]
        if all(t is not None for t in ends):  # the demo's agent loop (another one records no end: no timeline)
            finished = max(map(float, ends))
            metrics = {**metrics, "demo/rollout_s": max(0.0, finished - start),
                       "demo/reward_tail_s": max(0.0, end - finished)}
        if self.record_path:
            with open(self.record_path, "a") as out:
                for i, key in enumerate(batch.keys):
                    info = {k: float(v) for k, v in (extras[i].get("reward_extra_info") or {}).items()
                            if isinstance(v, (int, float))}
                    out.write(json.dumps({
                        "step": global_steps, "key": key, "reward": float(data["rm_scores"][i].sum()),
                        "reward_extra_info": info, "response_tokens": int(len(data["responses"][i])),
                        "digest": hashlib.sha1(repr((data["prompts"][i].tolist(), data["responses"][i].tolist()))
                                               .encode()).hexdigest()[:12],
                        "finished_s": None if ends[i] is None else float(ends[i]) - start,
                        "reward_wait_s": float((data["metrics"][i] or {}).get("compute_score") or 0.0),
                    }) + "\n")
        return batch, metrics
