"""Shared RM test cases: a few chat trajectories built with the tiny policy tokenizer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from verl_async_rm.request import RMRequest

QUESTIONS = ["how many apples does the farmer have", "what is the total cost of two books", "how fast is the train"]
ANSWERS = ["five", "the total cost is 12 dollars", "the train takes 3 hours so the speed is 20 miles per hour"]


def make_request(policy_tok, question: str, answer: str, uid: str, group: str | None = None) -> RMRequest:
    """A single-turn trajectory: the chat-templated question as prompt ids, the answer plus EOS as response ids."""
    messages = [{"role": "user", "content": question}]
    prompt = policy_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = policy_tok(prompt, add_special_tokens=False)["input_ids"]
    response_ids = policy_tok(answer, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
    return RMRequest(uid=uid, prompt_ids=prompt_ids, response_ids=response_ids, raw_prompt=messages, group=group)


def make_batch(policy_tok) -> list[RMRequest]:
    """One request per (question, answer) pair."""
    return [make_request(policy_tok, q, a, f"t{i}") for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS, strict=True))]


def hf_model(path):
    """A sequence-classification model loaded in fp32, eval mode: the reference the RM worker is compared with."""
    import torch
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


def direct_score(model, ids, index: int = 0) -> float:
    """The reference: one unpadded sequence through the plain HF model (its last token is the last row position)."""
    import torch

    with torch.inference_mode():
        return float(model(input_ids=torch.tensor([ids])).logits[0, index])


def save_nan_rm(rm_path, out_dir: Path) -> tuple[Path, int]:
    """Save a copy of the RM at ``rm_path`` whose ``</s>`` embedding is NaN; returns (path, poisoned token id)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_path)
    poison = tok.convert_tokens_to_ids("</s>")
    model = hf_model(rm_path)
    with torch.no_grad():
        model.get_input_embeddings().weight[poison] = float("nan")
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir, poison


def score_all(service, requests, timeout_s: float) -> list:
    """Each request's score, or its exception, through an RM service's one path (all submitted at once)."""
    from verl_async_rm.errors import remote_cause
    from verl_async_rm.service.client import score_with_timeout

    async def main():
        return await asyncio.gather(*(score_with_timeout(service, r, timeout_s=timeout_s) for r in requests),
                                    return_exceptions=True)

    return [remote_cause(r) if isinstance(r, BaseException) else r for r in asyncio.run(main())]


async def wait_stats(service, predicate, what: str, timeout_s: float = 180.0) -> dict:
    """Poll an RM service's ``stats()`` until ``predicate(stats)``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await service.stats.remote()
        if predicate(stats):
            return stats
        await asyncio.sleep(0.2)
    raise AssertionError(f"RM service never reached: {what}; last stats {stats}")


def remote_scores(config, requests, deadline_s: float = 120.0) -> tuple[list, dict]:
    """Each of ``requests`` scored by an ``RMService`` of ``config`` in this process (the actor's class, no Ray; its
    replicas the endpoint's slots), each with ``deadline_s``: the results and the step's figures."""
    from verl_async_rm.service.batching import BatchPolicy
    from verl_async_rm.service.service import RMService

    async def main():
        service = RMService(config, BatchPolicy(), name="remote")
        await service.start()
        try:
            return (await asyncio.gather(*(service.score(r, deadline_s) for r in requests)),
                    await service.end_step())
        finally:
            await service.close()

    return asyncio.run(main())
