"""verl 0.9.1's served RM returns no ``reward_extra_info`` (verl issue 7368): pinned here, with the demo's fix.

``RewardLoopWorker.compute_score_disrm`` is verl's own method, run unbound on a stand-in ``self`` whose HTTP call
returns a canned vLLM ``/classify`` answer (the test controls the transport, not the method under test). When a verl
release fixes the quirk, the first test fails: drop the fix in ``verl_async_rm.demo.served_rm`` then.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


def _stand_in_self():
    async def preprocess(data):
        return "<|im_start|>user\nhi<|im_end|>\n"

    async def post(payload, endpoint):
        assert endpoint == "classify" and payload["use_activation"] is False
        return {"data": [{"probs": [0.25]}]}

    config = SimpleNamespace(reward=SimpleNamespace(reward_model=SimpleNamespace(
        rollout=SimpleNamespace(name="vllm"), model_path="/rm")))
    return SimpleNamespace(config=config, _preprocess_reward_inputs=preprocess, _post_request=post)


def test_verls_served_rm_result_lacks_the_key_its_agent_loop_reads():
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    result = asyncio.run(RewardLoopWorker.compute_score_disrm(_stand_in_self(), data=None))
    assert result == {"reward_score": 0.25}  # AgentLoopWorker._compute_score reads result["reward_extra_info"]


def test_the_demos_worker_adds_an_empty_reward_extra_info_and_times_the_call():
    from verl_async_rm.demo.served_rm import TimedRewardLoopWorker

    worker = TimedRewardLoopWorker.__new__(TimedRewardLoopWorker)  # no engine, no tokenizer: the transport stands in
    worker.__dict__.update(vars(_stand_in_self()), _calls=[])
    result = asyncio.run(TimedRewardLoopWorker.compute_score_disrm(worker, data=None))
    assert result == {"reward_score": 0.25, "reward_extra_info": {}}
    (start, end), = TimedRewardLoopWorker.pop_calls(worker)
    assert start <= end and TimedRewardLoopWorker.pop_calls(worker) == []
