"""Settings of ``verl-async-rm demo`` (one typed dataclass; the CLI fills it from its options)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DemoConfig", "ROLLOUTS"]

#: Values of ``DemoConfig.rollout_backend``.
ROLLOUTS = ("auto", "vllm", "standin")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: the same workload in every mode (the plugin, the RM after the rollout, verl's served RM)."""

    steps: int = field(default=3, metadata={"help": "Rollout steps per mode."})
    batch_size: int = field(default=32, metadata={"help": "Trajectories per step (prompts, rollout.n=1)."})
    seed: int = field(default=0, metadata={"help": "Seeds the tiny models and the synthetic response lengths."})
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where the tiny models are built (default: $VERL_ASYNC_RM_CACHE or ~/.cache)."}
    )
    out_dir: str | None = field(
        default=None, metadata={"help": "Output folder (default: a fresh ./async_rm_demo/<timestamp>)."}
    )
    rollout_backend: str = field(
        default="auto",
        metadata={"help": "Who generates: 'vllm' (verl's own vLLMReplica, vLLM's CPU build; also runs the "
                          "verl_served mode), 'standin' (the CPU stand-in server, simulated decode time; no "
                          "verl_served mode), or 'auto' (vllm where it is installed, else standin, saying why)."},
    )
    rm_replicas: int = field(
        default=2,
        metadata={"help": "CPU RM replicas (the rm_wg), one Ray bundle of 1 CPU each; verl's served RM gets as many "
                          "vLLM engines."},
    )
    response_length: int = field(default=256, metadata={"help": "Longest response (data.max_response_length)."})
    median_tokens: float = field(
        default=40.0,
        metadata={"help": "Median response length (log-normal; the demo's agent loop draws each trajectory's length)."},
    )
    sigma: float = field(default=1.0, metadata={"help": "Log-normal sigma of the response lengths (the tail)."})
    decode_s_per_token: float = field(
        default=0.02, metadata={"help": "Simulated decode time per response token (the stand-in rollout only)."}
    )
    rm_hidden_size: int = field(default=384, metadata={"help": "Hidden size of the demo RM (CPU cost of scoring)."})
    rm_layers: int = field(default=6, metadata={"help": "Layers of the demo RM."})
    rm_micro_batch_tokens: int = field(
        default=1024,
        metadata={"help": "async_rm.micro_batch_max_tokens: padded tokens per RM forward; rows are grouped by length, "
                          "so a large batch scored after the rollout is not padded to its longest response."},
    )
    max_batch_size: int = field(default=8, metadata={"help": "async_rm.max_batch_size of the executor."})
    max_wait_ms: float = field(default=50.0, metadata={"help": "async_rm.max_wait_ms of the executor."})
    rm_weight: float = field(default=1.0, metadata={"help": "async_rm.rm_weight."})
    rule_weight: float = field(default=0.5, metadata={"help": "async_rm.rule_weight (rule: verl_async_rm.demo.rule)."})
    step_timeout_s: float = field(default=300.0, metadata={"help": "Longest one step of either mode may take."})
    split_cores: bool = field(
        default=True,
        metadata={"help": "Give the policy's vLLM engine half of the machine's cores and the RM (the plugin's "
                          "replicas, verl's served-RM engines) the other half, as a cluster gives each its own GPUs."},
    )
    progress: bool = field(default=True, metadata={"help": "Show a progress bar on stderr."})

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "rm_replicas", "response_length", "rm_hidden_size", "rm_layers",
                     "rm_micro_batch_tokens", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"demo {name}={value!r}: must be an integer >= 1, e.g. --{name.replace('_', '-')} 2")
        if self.rm_hidden_size % 64:
            raise ValueError(f"demo rm_hidden_size={self.rm_hidden_size}: must be a multiple of 64 (heads of 64, "
                             "which vLLM's CPU attention accepts), e.g. 384")
        for name in ("median_tokens", "decode_s_per_token", "max_wait_ms", "step_timeout_s", "sigma",
                     "rm_weight", "rule_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"demo {name}={value!r}: must be a finite number")
        for name in ("median_tokens", "step_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"demo {name}={getattr(self, name)!r}: must be > 0")
        for name in ("decode_s_per_token", "max_wait_ms", "sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"demo {name}={getattr(self, name)!r}: must be >= 0")
        if self.rollout_backend not in ROLLOUTS:
            raise ValueError(f"demo rollout_backend={self.rollout_backend!r}: must be one of {ROLLOUTS}, e.g. "
                             "--rollout-backend vllm")
        if self.rm_weight == 0 and self.rule_weight == 0:
            raise ValueError("demo rm_weight and rule_weight are both 0: the reward would be 0; set --rm-weight 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
