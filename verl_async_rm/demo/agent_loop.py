"""The demo's agent loop: verl's single-turn loop with a heavy-tailed response length of its own per trajectory.

A tiny random policy rarely stops by itself, so on verl's real vLLM rollout every response would run to
``max_response_length``. Real RL rollouts finish spread out with a long tail: most near the median, a few many times
longer. This loop gives each trajectory its own ``max_tokens``, drawn from a log-normal seeded by the demo's seed and
the prompt's text, with ``ignore_eos`` so the response has exactly that length: every run of the same prompts gets the
same lengths. Decoding is greedy (``greedy: true``, the same response for the same prompt and weights, so several
ways of scoring compare on the same text) or verl's sampling (``greedy: false``, what GRPO training needs: different
responses within a group). The response holds ordinary tokens only (``allowed_token_ids``): a forced length would
otherwise let an untrained policy write end-of-sequence or chat-format tokens mid-response, which no trained policy
does.

It also records when its generation ended (``extra_fields["demo_finished_at"]``, ``time.time()``), which the demo
reads back from TransferQueue for the timeline. Registered through the agent-loop YAML the demo writes
(:func:`write_agent_loop_config`); verl instantiates it with that YAML entry's keys as arguments.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

__all__ = ["AGENT_NAME", "FINISHED_AT", "LogNormalLengthAgentLoop", "response_tokens", "write_agent_loop_config"]

#: The name prompts use (``agent_name``) and the demo sets as verl's ``default_agent_loop``.
AGENT_NAME = "demo_lognormal"
#: Key of ``extra_fields`` holding when the trajectory's generation ended.
FINISHED_AT = "demo_finished_at"


def response_tokens(raw_prompt: Any, *, median_tokens: float, sigma: float, seed: int, budget: int) -> int:
    """The response length the demo gives ``raw_prompt``: log-normal around ``median_tokens``, in ``[1, budget]``.

    A function of (seed, prompt text) only, so every mode and every process draws the same length.
    """
    text = json.dumps(list(raw_prompt), sort_keys=True, default=str)
    digest = hashlib.sha256(f"{seed}|{text}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    return max(1, min(budget, int(round(rng.lognormvariate(math.log(median_tokens), sigma)))))


class LogNormalLengthAgentLoop(SingleTurnAgentLoop):
    """``SingleTurnAgentLoop`` with the response length of :func:`response_tokens`, greedy or sampled."""

    def __init__(self, *args: Any, median_tokens: float = 40.0, sigma: float = 1.0, seed: int = 0,
                 greedy: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.median_tokens, self.sigma, self.seed = float(median_tokens), float(sigma), int(seed)
        self.greedy = bool(greedy)
        specials = set(self.tokenizer.all_special_ids)
        self.ordinary_ids = [i for i in range(len(self.tokenizer)) if i not in specials]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
        tokens = response_tokens(kwargs["raw_prompt"], median_tokens=self.median_tokens, sigma=self.sigma,
                                 seed=self.seed, budget=self.response_length)
        params = {**sampling_params, "max_tokens": tokens, "ignore_eos": True, "allowed_token_ids": self.ordinary_ids}
        if self.greedy:
            params["temperature"] = 0.0
        output = await super().run(params, **kwargs)
        output.extra_fields[FINISHED_AT] = time.time()
        return output


def write_agent_loop_config(path: str | Path, *, median_tokens: float, sigma: float, seed: int,
                            greedy: bool = True, extra: dict[str, str] | None = None) -> Path:
    """Write verl's agent-loop YAML (``actor_rollout_ref.rollout.agent.agent_loop_config_path``) for this loop,
    named :data:`AGENT_NAME`; ``extra`` adds entries ``name -> class path`` with the same settings (a subclass)."""
    path = Path(path)
    entries = {AGENT_NAME: f"{__name__}.{LogNormalLengthAgentLoop.__name__}", **(extra or {})}
    path.write_text("".join(
        f"- name: {name}\n"
        f"  _target_: {target}\n"
        f"  median_tokens: {float(median_tokens)!r}\n"
        f"  sigma: {float(sigma)!r}\n"
        f"  seed: {int(seed)}\n"
        + ("" if greedy else "  greedy: false\n")
        for name, target in entries.items()
    ))
    return path
