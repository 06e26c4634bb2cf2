"""A group judge on real parts: the RM service actor with one replica running vLLM's CPU build, scoring GRPO groups
with the tiny ``json`` judge (``verl_async_rm.testing.judges``), whose free text (``7}7}...``) is never a JSON object:
only vLLM's structured output (the schema of a number per label) makes its reply read, so every score here is the
schema at work. Each complete group is one judge call; a short group is judged with the responses that came, once
``group_wait_s`` has passed.

Skips with the reason where vLLM cannot run; ``VERL_ASYNC_RM_REQUIRE_VLLM=1`` (set by ``.ci/run``) turns that skip
into a failure."""

from __future__ import annotations

import json
import time

import pytest
import ray
from conftest import require_vllm
from rm_cases import make_request

from verl_async_rm.request import RMRequest, Verdict
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.service import start_rm_service
from verl_async_rm.testing.judges import JSON_DIGIT

pytestmark = pytest.mark.integration

HANG_S = 180.0
N = 4  # rollout.n
ANSWERS = ["the farmer has 7 apples", "it costs 12 dollars", "five plus two is seven", "no",
           "half of ten is five", "the total is 30 pens", "she bought eggs", "two trains"]


@pytest.fixture(scope="module")
def group_service(ray_local, tiny_models, tiny_judges):
    require_vllm()
    config = RMConfig(model_path=str(tiny_judges.json), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      reward_kind="group_judge", judge_max_tokens=48, judge_scale=JSON_DIGIT, group_wait_s=3.0,
                      n_gpus_per_node=1, nnodes=1, placement_timeout_s=60, init_timeout_s=180)
    service = start_rm_service(config, BatchPolicy(max_batch_size=8, max_wait_ms=20),
                               name=f"group_judge_{time.monotonic_ns()}")
    yield service
    ray.get(service.close.remote(), timeout=HANG_S)
    ray.kill(service)


def members(policy_tok, group: str, count: int, size: int, first: int = 0) -> list[RMRequest]:
    out = []
    for j in range(count):
        request = make_request(policy_tok, f"question of {group}", ANSWERS[(first + j) % len(ANSWERS)],
                               uid=f"{group}/{j}", group=group)
        out.append(RMRequest(**{**vars(request), "group_size": size}))
    return out


def test_groups_are_scored_on_vllm_by_structured_output_one_call_per_group(group_service, policy_tok):
    complete = [m for g in range(3) for m in members(policy_tok, f"uid-{g}", N, N, first=3 * g)]
    short = members(policy_tok, "uid-short", 2, N)  # two siblings never come: judged after group_wait_s
    ray.get(group_service.end_step.remote(), timeout=HANG_S)  # the step's counters start here
    refs = [group_service.score.remote(m, deadline_s=HANG_S) for m in complete + short]
    results = ray.get(refs, timeout=HANG_S)
    step = ray.get(group_service.end_step.remote(), timeout=HANG_S)

    for request, result in zip(complete + short, results, strict=True):
        assert isinstance(result, Verdict), (request.uid, result)
        label, reply = result.text.split("] ", 1)
        count = 2 if request.group == "uid-short" else N
        assert json.loads(reply) == {str(i): JSON_DIGIT for i in range(1, count + 1)}  # exactly the labels, compact
        assert 1 <= int(label.removeprefix("[")) <= count and result.score == 1.0  # 7 / judge_scale
    for group in ("uid-0", "uid-1", "uid-2", "uid-short"):  # each label once per group
        labels = sorted(r.text.split("]")[0] for m, r in zip(complete + short, results, strict=True)
                        if m.group == group)
        assert labels == [f"[{i}" for i in range(1, len(labels) + 1)]
    assert (step["requests"], step["scored"], step["errors"]) == (14, 14, 0)
    assert (step["groups_judged"], step["groups_partial"], step["judge_calls"]) == (4, 1, 4)
    assert step["judge_parse_failures"] == 0 and step["group_wait_s/p99"] >= 3.0
    assert step["judge_tokens_out_per_trajectory"] < step["judge_tokens_in_per_trajectory"]
    info = ray.get(group_service.describe.remote(), timeout=60)[0]
    assert info["engine"] == "vllm" and info["judge_readout"] == "generate"
