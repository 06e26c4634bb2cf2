"""The CPU generation server (no model: drawn lengths, random ordinary tokens) answers verl's real LLMServerClient
through verl's real router, on a local Ray cluster."""

from __future__ import annotations

import asyncio

import pytest

from verl_async_rm.testing import LengthDistribution, compose_trainer_config, make_llm_client, start_generation_servers

pytestmark = pytest.mark.integration

TIMEOUT_S = 120


def _prompt(tok, text="how many apples are left?"):
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def test_responses_are_heavy_tailed_deterministic_and_spread_over_servers(ray_local, tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    config = compose_trainer_config(tiny_models.policy, trainer="v1", response_length=256)
    kwargs = dict(model_path=str(tiny_models.policy), response_length=256, seed=3,
                  lengths=LengthDistribution(median_tokens=16, sigma=1.2), decode_s_per_token=0.0005)
    prompts = [_prompt(tok, f"question {i}") for i in range(40)]

    servers = start_generation_servers(2, name_prefix="syn", **kwargs)
    client = make_llm_client(config, servers)

    async def run_all():
        return await asyncio.wait_for(asyncio.gather(*(
            client.generate(f"r{i}", prompt_ids=p, sampling_params={"temperature": 1.0})
            for i, p in enumerate(prompts))), TIMEOUT_S)

    first = asyncio.run(run_all())
    lengths = [len(o.token_ids) for o in first]
    assert all(1 <= n <= 256 for n in lengths)
    assert len(set(lengths)) > 5 and max(lengths) > 3 * sorted(lengths)[len(lengths) // 2]
    assert all(o.token_ids[-1] == tok.eos_token_id for o in first)
    special = set(tok.all_special_ids)
    assert not any(t in special for o in first for t in o.token_ids[:-1])

    import ray

    counts = [ray.get(h.stats.remote(), timeout=TIMEOUT_S)["num_requests"] for h in servers.values()]
    assert sum(counts) == len(prompts) and min(counts) > 0

    # the same workload again, once the servers forget what they saw: the same responses, whichever server the
    # balancer now sends each prompt to
    ray.get([h.reset.remote() for h in servers.values()], timeout=TIMEOUT_S)
    again = asyncio.run(run_all())
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
