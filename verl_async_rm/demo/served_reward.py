"""The reward function of the demo's ``verl_served`` mode: verl's own vLLM-served RM, called the way verl 0.9.1 lets a
custom reward function call it.

With ``reward.reward_model.enable=True`` on a pool of its own, verl serves the RM on vLLM behind its router and scores
each trajectory as its agent loop ends. Its default path (``RewardLoopWorker.compute_score_disrm``) returns no
``reward_extra_info``, which ``AgentLoopWorker._compute_score`` reads, so it fails every trajectory (verl issue 7368).
verl's documented alternative is a custom reward function: verl's reward manager then passes it the router's address
and the RM's tokenizer. This one sends the request ``compute_score_disrm`` would send (the conversation rendered with
the RM's chat template, ``/classify`` with ``use_activation=False``) and returns the raw RM score. verl's reward
manager gives it the decoded response and the dataset's ``extra_info``, not the prompt's messages: the demo's data
keeps the question in ``extra_info["question"]``.
"""

from __future__ import annotations

from typing import Any

import aiohttp

__all__ = ["compute_score", "rm_request"]

#: Longest one ``/classify`` request may take.
REQUEST_TIMEOUT_S = 300.0


def rm_request(question: str, response: str, model_path: str, reward_model_tokenizer: Any) -> dict[str, Any]:
    """The ``/classify`` payload verl's ``compute_score_disrm`` sends for one trajectory (its BOS strip included)."""
    text = reward_model_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": response}],
        add_generation_prompt=False, tokenize=False)
    bos = reward_model_tokenizer.bos_token
    if bos is not None and text.startswith(bos):
        text = text[len(bos):]
    return {"model": model_path, "input": text, "use_activation": False}


async def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: dict | None = None, *,
                        reward_router_address: str, reward_model_tokenizer: Any, model_path: str,
                        **kwargs: Any) -> dict[str, float]:
    """verl's custom reward function signature (async); ``model_path`` (the RM, vLLM's served model name) comes from
    ``+reward.custom_reward_function.reward_kwargs.model_path``. Returns ``{"score": rm_score, "rm_score": ...}``."""
    question = (extra_info or {}).get("question")
    if question is None:
        raise ValueError("the demo's verl_served reward needs extra_info['question'] (the demo's data has it)")
    payload = rm_request(question, solution_str, model_path, reward_model_tokenizer)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        async with session.post(f"http://{reward_router_address}/classify", json=payload) as resp:
            resp.raise_for_status()
            output = await resp.json()
    score = float(output["data"][-1]["probs"][-1])
    return {"score": score, "rm_score": score}
