"""The demo's timeline on verl's v0 trainer (``--trainer v0``): v0 has no replay buffer to wrap (the v1 demo's
:mod:`~verl_async_rm.demo.sampler`), so the agent-loop manager itself times each training batch and writes its
trajectories, the same figures the v1 sampler gives:

- ``demo/rollout_s``: from ``generate_sequences``' call to the last generation's end (the demo's agent loop records
  it, ``extra_fields["demo_finished_at"]``: a column of v0's output);
- ``demo/reward_tail_s``: from then until ``generate_sequences`` returned the batch, every reward known.

Both go into the batch's ``meta_info["timing"]`` (verl's v0 fit loop logs them as ``timing_s/demo/...``); the
trajectories go to ``trainer.v1.sampler.sampler_kwargs.record_path`` (the key the v1 demo sets; the v0 trainer does
not read it). One class per manager the demo's modes name: the plugin's v0 manager, and verl's own for the modes
without the plugin."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await

from verl_async_rm.demo.agent_loop import FINISHED_AT
from verl_async_rm.integration.agent_loop_manager import AsyncRMAgentLoopManagerV0

__all__ = ["TimedAgentLoopManager", "TimedAsyncRMAgentLoopManager", "RECORD_KEY"]

#: Where the trajectories are written (a path; the v1 demo's sampler reads the same key).
RECORD_KEY = "trainer.v1.sampler.sampler_kwargs.record_path"


class _Timed:
    """``generate_sequences`` timed and its trajectories recorded (module doc)."""

    @auto_await
    async def generate_sequences(self, prompts: Any) -> Any:
        start = time.time()
        output = await super().generate_sequences(prompts)  # type: ignore[misc]
        end = time.time()
        if prompts.meta_info.get("validate", False):
            return output
        finished = max(float(t) for t in output.non_tensor_batch[FINISHED_AT])
        output.meta_info["timing"] = {**output.meta_info.get("timing", {}),
                                      "demo/rollout_s": max(0.0, finished - start),
                                      "demo/reward_tail_s": max(0.0, end - finished)}
        self._record(prompts, output, start)
        return output

    def _record(self, prompts: Any, output: Any, start: float) -> None:
        from omegaconf import OmegaConf

        path = OmegaConf.select(self.config, RECORD_KEY, default=None)  # type: ignore[attr-defined]
        if not path:
            return
        batch, columns = output.batch, output.non_tensor_batch
        keys = output.meta_info.get("reward_extra_keys") or []
        uids = prompts.non_tensor_batch.get("uid")
        step = prompts.meta_info.get("global_steps")
        with open(path, "a") as out:
            for i in range(len(output)):
                mask = batch["response_mask"][i].bool()
                prompt, response = batch["prompts"][i], batch["responses"][i][mask]
                info = {k: float(columns[k][i]) for k in keys if isinstance(columns[k][i], (int, float))}
                out.write(json.dumps({
                    "step": step, "key": f"{uids[i]}_{i}" if uids is not None else str(i),
                    "reward": float(batch["rm_scores"][i].sum()), "reward_extra_info": info,
                    "response_tokens": int(mask.sum()),
                    "digest": hashlib.sha1(repr((prompt[prompt != 0].tolist(), response.tolist())).encode())
                    .hexdigest()[:12],
                    "finished_s": float(columns[FINISHED_AT][i]) - start,
                    # not measured on v0: the batch's metrics read 0.0 here in every mode, the plugin's included
                    "reward_wait_s": None}) + "\n")


class TimedAsyncRMAgentLoopManager(_Timed, AsyncRMAgentLoopManagerV0):
    """The plugin's v0 manager, timed (the demo's modes with the plugin, ``--trainer v0``)."""


class TimedAgentLoopManager(_Timed, AgentLoopManager):
    """verl's own v0 manager, timed (the demo's modes without the plugin, ``--trainer v0``)."""
