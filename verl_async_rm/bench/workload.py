"""The overlap benchmark's workload: seeded, heavy-tailed rollout finish times and token lengths, and the RM cost model.

A rollout step starts ``B`` trajectories at time 0. Trajectory ``i`` has a prompt of ``prompt_tokens[i]`` and a response
of ``response_tokens[i]`` tokens, both drawn from :class:`~verl_async_rm.testing.generation.LengthDistribution`
(log-normal, clipped), so the lengths have the long tail of real RL rollouts: most responses near the median, a few
many times longer, and a small heap at the response-length cap (truncated responses). A trajectory finishes when its
response is decoded::

    finish_s[i] = prefill_s + response_tokens[i] * decode_s_per_token * speed[i]

where ``speed[i]`` is a log-normal jitter (median 1, ``speed_sigma``) for the uneven decode speed of sequences on
different rollout replicas and in batches of different occupancy. Finish times thus inherit the lengths' heavy tail;
the last trajectories to finish are the longest ones, which is what makes the reward tail matter.

The defaults describe a 7B policy decoding with vLLM at a large batch (about 12 ms per token per sequence, so a
4096-token response takes about 50 s) and GSM8K/chat-like prompts. Times are "workload seconds"; the benchmark may run
them faster than real time (see :mod:`verl_async_rm.bench.overlap`).

:class:`RMCostModel` is the simulated RM: a batch of ``n`` items whose longest has ``L`` tokens takes
``a_s + b_s_per_token * n * L`` (right padding: every row costs the longest row). Default ``a`` and ``b`` are those of
a ~7B RM scoring on one H100 in bf16 (see the class).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from verl_async_rm.testing.generation import LengthDistribution

__all__ = ["RMCostModel", "Workload", "WorkloadConfig", "generate_workload"]


@dataclass(frozen=True)
class RMCostModel:
    """Latency of one RM batch: ``a_s + b_s_per_token * padded_tokens`` with ``padded_tokens = size * longest``.

    Defaults (a ~7B RM, one H100, bf16, HF forward with SDPA attention): a forward costs about 2 x 7e9 FLOPs per token;
    at ~35-40% of the H100's 989 dense bf16 TFLOP/s that is 35-40 us per token (25-28k tokens/s, in line with published
    prefill throughputs of 7-8B models on one H100), so ``b = 40 us/token``. ``a = 30 ms`` covers a batch's fixed cost:
    the launch of ~32 layers of kernels, tokenization/collation and the host-device copies and synchronisation of one
    RM call behind a Ray actor. ``--rm tiny`` replaces both by a fit of the real tiny RM on this CPU.
    """

    a_s: float = field(default=0.030, metadata={"help": "Fixed cost of one batch, seconds."})
    b_s_per_token: float = field(default=40e-6, metadata={"help": "Cost per padded token, seconds."})
    source: str = field(default="default: ~7B RM on one H100 (bf16, 2N FLOPs/token at ~40% MFU; 30 ms per call)",
                        metadata={"help": "Where a and b come from (reported in the JSON)."})

    def __post_init__(self) -> None:
        for name in ("a_s", "b_s_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"RMCostModel.{name} must be a finite number >= 0, got {value!r}")
        if self.a_s == 0 and self.b_s_per_token == 0:
            raise ValueError("RMCostModel needs a_s > 0 or b_s_per_token > 0; a free RM makes the benchmark moot")

    def padded_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens one batch costs: its size times its longest item."""
        return len(lengths) * max(lengths) if lengths else 0

    def batch_s(self, lengths: Sequence[int]) -> float:
        """Seconds one batch of items with these token counts takes."""
        if not lengths:
            raise ValueError("RMCostModel.batch_s needs at least one item")
        return self.a_s + self.b_s_per_token * self.padded_tokens(lengths)

    def lone_s(self, tokens: int) -> float:
        """Seconds one request takes alone (no batching, no padding)."""
        return self.a_s + self.b_s_per_token * tokens


@dataclass(frozen=True)
class WorkloadConfig:
    """How the rollout's trajectories are drawn (see the module docstring)."""

    trajectories: int = field(default=1024, metadata={"help": "Trajectories in the step (B)."})
    seed: int = field(default=0, metadata={"help": "Seeds every draw; the same config gives the same workload."})
    prompt_lengths: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median_tokens=256, sigma=0.5, min_tokens=16, max_tokens=2048),
        metadata={"help": "Prompt lengths in tokens."},
    )
    response_lengths: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median_tokens=512, sigma=1.0, min_tokens=1, max_tokens=4096),
        metadata={"help": "Response lengths in tokens (the cap is the rollout's response_length)."},
    )
    prefill_s: float = field(default=1.0, metadata={"help": "Time before the first response token, seconds."})
    decode_s_per_token: float = field(default=0.012, metadata={"help": "Decode time per response token, seconds."})
    speed_sigma: float = field(default=0.15, metadata={"help": "Sigma of the log-normal per-trajectory speed jitter."})
    rollout_n: int = field(
        default=1,
        metadata={"help": "Responses per prompt (GRPO's rollout.n): trajectories i with the same i // rollout_n are "
                          "siblings, with one prompt (its length drawn for the first of them)."},
    )

    def __post_init__(self) -> None:
        if isinstance(self.trajectories, bool) or not isinstance(self.trajectories, int) or self.trajectories < 1:
            raise ValueError(f"WorkloadConfig.trajectories must be an integer >= 1, got {self.trajectories!r}")
        if isinstance(self.rollout_n, bool) or not isinstance(self.rollout_n, int) or self.rollout_n < 1:
            raise ValueError(f"WorkloadConfig.rollout_n must be an integer >= 1, got {self.rollout_n!r}")
        for name in ("prefill_s", "decode_s_per_token", "speed_sigma"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"WorkloadConfig.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """One drawn rollout step: per trajectory (index ``i``), its finish time and token counts."""

    finish_s: tuple[float, ...]
    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    rollout_n: int = 1

    def group(self, i: int) -> int | None:
        """Trajectory ``i``'s prompt (``i // rollout_n``), or None when every trajectory has its own."""
        return i // self.rollout_n if self.rollout_n > 1 else None

    @property
    def size(self) -> int:
        return len(self.finish_s)

    @property
    def tokens(self) -> tuple[int, ...]:
        """RM input length of each trajectory: prompt plus response."""
        return tuple(p + r for p, r in zip(self.prompt_tokens, self.response_tokens))

    @property
    def rollout_s(self) -> float:
        """When the last trajectory finishes."""
        return max(self.finish_s)

    @property
    def last(self) -> int:
        """Index of the trajectory that finishes last (the lowest index on a tie)."""
        return max(range(self.size), key=lambda i: (self.finish_s[i], -i))

    def summary(self) -> dict[str, float]:
        """Percentiles of finish times and lengths (for the report)."""
        finish = sorted(self.finish_s)
        tokens = sorted(self.tokens)

        def q(values: list, p: float) -> float:
            return values[min(len(values) - 1, int(p * len(values)))]

        return {
            "trajectories": self.size,
            "finish_s_p50": q(finish, 0.5), "finish_s_p90": q(finish, 0.9), "finish_s_p99": q(finish, 0.99),
            "rollout_s": self.rollout_s,
            "tokens_p50": q(tokens, 0.5), "tokens_p99": q(tokens, 0.99), "tokens_max": tokens[-1],
            "tokens_total": sum(tokens),
        }


def generate_workload(config: WorkloadConfig | None = None) -> Workload:
    """Draw a workload; deterministic in ``config`` (one ``random.Random(seed)``, draws in a fixed order)."""
    config = config or WorkloadConfig()
    rng = random.Random(config.seed)
    prompt_budget = config.prompt_lengths.max_tokens or 1 << 30
    response_budget = config.response_lengths.max_tokens or 1 << 30
    prompts, responses, finish = [], [], []
    for i in range(config.trajectories):
        prompt = config.prompt_lengths.sample(rng, prompt_budget)  # drawn for every trajectory: same draw order
        if i % config.rollout_n:
            prompt = prompts[-1]  # a sibling: its group's prompt
        response = config.response_lengths.sample(rng, response_budget)
        speed = rng.lognormvariate(0.0, config.speed_sigma) if config.speed_sigma > 0 else 1.0
        prompts.append(prompt)
        responses.append(response)
        finish.append(config.prefill_s + response * config.decode_s_per_token * speed)
    return Workload(finish_s=tuple(finish), prompt_tokens=tuple(prompts), response_tokens=tuple(responses),
                    rollout_n=config.rollout_n)
