"""A replica that does not answer within ``batch_timeout_s``, on verl's v1 trainer: the step's trajectories fail with
``RequestTimeoutError`` on time, and under ``on_error=raise`` the run stops at the step's end naming that cause.

Its own manager: ``batch_timeout_s`` is far below the tiny RM's time per batch, so every batch times out (the late
replica is then killed and replaced, as the faults table of docs/faults.md says). It keeps the stubbed fit loop
(:class:`~verl_async_rm.testing.V1FitLoop` with the synthetic generation server): it controls time against a deadline
(every batch must outlast 1 ms, and nothing else may); verl's real trainer stopping at a failed step under
``on_error=raise`` is ``test_manager_v1.py``'s."""

from __future__ import annotations

import pytest
from manager_cases import TWO_REPLICAS, running_manager

pytestmark = pytest.mark.integration


def test_a_batch_past_batch_timeout_fails_its_trajectories_and_stops_the_run(ray_local, tiny_models):
    from verl_async_rm.errors import RMScoreError
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    with running_manager(ray_local, tiny_models, "v1", "+async_rm.batch_timeout_s=0.001",
                         TWO_REPLICAS) as (manager, config):
        loop = V1FitLoop(config, manager)
        with pytest.raises(RMScoreError, match=r"4 of 4 trajectories of step 1 got no RM score.*RequestTimeoutError: "
                                               r".*batch of \d+.*batch_timeout_s=0.001"):
            loop.train_step(prompt_batch(["too slow for the limit", "this one too"]))
        assert manager.last_metrics["async_rm/errors"] == 4 and manager.last_metrics["async_rm/scored"] == 0
