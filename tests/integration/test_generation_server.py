"""The CPU generation server (no model: drawn lengths, random ordinary tokens) answers verl's real LLMServerClient
through verl's real load balancer, on a local Ray cluster: the cluster's shared server (``manager_cases.generation``,
the one every manager test of the cluster then uses), not one of its own (each server and balancer is a process that
imports verl: seconds of a 2-core machine)."""

from __future__ import annotations

import asyncio

import pytest
from manager_cases import generation

from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.integration

TIMEOUT_S = 120
RESPONSE_LENGTH = 24  # manager_cases.generation's servers: responses of at most 24 tokens, median 8


def _prompt(tok, text="how many apples are left?"):
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def test_responses_are_heavy_tailed_deterministic_and_ordinary(ray_local, tiny_models):
    import ray
    from transformers import AutoTokenizer
    from verl.workers.rollout.llm_server import LLMServerClient

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    config = compose_trainer_config(tiny_models.policy, trainer="v1", response_length=RESPONSE_LENGTH)
    prompts = [_prompt(tok, f"question {i}") for i in range(40)]
    servers, balancer = generation(ray_local, tiny_models)  # reset: it forgets what earlier tests sent
    client = LLMServerClient(config=config, load_balancer_handle=balancer)

    async def run_all():
        return await asyncio.wait_for(asyncio.gather(*(
            client.generate(f"r{i}", prompt_ids=p, sampling_params={"temperature": 1.0})
            for i, p in enumerate(prompts))), TIMEOUT_S)

    first = asyncio.run(run_all())
    lengths = sorted(len(o.token_ids) for o in first)
    assert all(1 <= n <= RESPONSE_LENGTH for n in lengths)
    assert len(set(lengths)) > 5 and lengths[-1] > 2 * lengths[len(lengths) // 2]  # a long tail
    assert all(o.token_ids[-1] == tok.eos_token_id for o in first)
    special = set(tok.all_special_ids)
    assert not any(t in special for o in first for t in o.token_ids[:-1])
    counts = [ray.get(h.stats.remote(), timeout=TIMEOUT_S)["num_requests"] for h in servers.values()]
    assert sum(counts) == len(prompts)

    # the same workload again, once the server forgets what it saw: the same responses
    ray.get([h.reset.remote() for h in servers.values()], timeout=TIMEOUT_S)
    again = asyncio.run(run_all())
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
