"""The synthetic generation server's finish records and reset (what the demo's rollout curve is built from)."""

from __future__ import annotations

import asyncio
import time

import pytest

from verl_async_rm.testing import CPUGenerationServer, LengthDistribution

pytestmark = pytest.mark.unit


def _server():
    return CPUGenerationServer(prompt_length=16, response_length=64, seed=3,
                               lengths=LengthDistribution(median_tokens=8, sigma=1.0), vocab_size=50)


async def _ask(server, prompt, rid):
    return await server.generate(prompt_ids=prompt, sampling_params={}, request_id=rid)


def test_every_answer_is_recorded_once_with_its_length():
    server = _server()
    before = time.time()
    outs = asyncio.run(_gather(server, [[1, 2, 3], [4, 5], [1, 2, 3]]))
    records = server.pop_finished()
    assert [r["request_id"] for r in records] == ["r0", "r1", "r2"]
    assert [r["tokens"] for r in records] == [len(o.token_ids) for o in outs]
    assert all(before <= r["end"] <= time.time() for r in records)
    assert server.pop_finished() == []


def test_reset_replays_the_same_lengths_for_the_same_prompts():
    server = _server()
    prompts = [[7, 8, 9]] * 4  # a repeated prompt: each repeat draws a new length
    first = [len(o.token_ids) for o in asyncio.run(_gather(server, prompts))]
    again = [len(o.token_ids) for o in asyncio.run(_gather(server, prompts))]
    server.reset()
    replay = [len(o.token_ids) for o in asyncio.run(_gather(server, prompts))]
    assert replay == first and again != first
    assert len(server.pop_finished()) == 4  # reset dropped the earlier records


async def _gather(server, prompts):
    return [await _ask(server, p, f"r{i}") for i, p in enumerate(prompts)]
