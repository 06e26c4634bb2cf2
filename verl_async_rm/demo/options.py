"""Settings of ``verl-async-rm demo`` (one typed dataclass; the CLI fills it from its options)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ALL_MODES", "DEFAULT_MODES", "DemoConfig"]

#: Every mode, in the order they run and print: the plugin on its own pool, verl's own served RM on its own pool, the
#: plugin on the policy's GPUs, and no RM (the rule reward alone: the floor on step time).
ALL_MODES = ("plugin", "verl_served", "plugin_colocated", "no_rm")
#: What ``verl-async-rm demo`` runs unless ``--modes`` says otherwise (about 4 minutes on 2 cores).
DEFAULT_MODES = ("plugin", "no_rm")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains: verl's own trainer (``main_ppo``), the same data, seeds and steps in every mode."""

    modes: str = field(
        default=",".join(DEFAULT_MODES),
        metadata={"help": f"Comma-separated modes to run, of {', '.join(ALL_MODES)}; 'all' for every mode (the full "
                          "comparison, about twice as long)."},
    )
    trainer: str = field(default="v1", metadata={
        "help": "verl's trainer: 'v1' (its TransferQueue trainer, verl 0.9.1's default) or 'v0' (RayPPOTrainer, "
                "trainer.use_v1=False)."})
    steps: int = field(default=8, metadata={"help": "GRPO training steps per mode (trainer.total_training_steps)."})
    prompts: int = field(default=8, metadata={"help": "Prompts per step (data.train_batch_size)."})
    rollout_n: int = field(default=4, metadata={"help": "Responses per prompt (actor_rollout_ref.rollout.n)."})
    response_length: int = field(default=48, metadata={"help": "Longest response (data.max_response_length)."})
    median_tokens: float = field(
        default=16.0, metadata={"help": "Median response length (log-normal; each prompt's length is fixed per seed)."}
    )
    sigma: float = field(default=0.8, metadata={"help": "Log-normal sigma of the response lengths (the tail)."})
    lr: float = field(default=0.05, metadata={"help": "The actor's learning rate (actor_rollout_ref.actor.optim.lr)."})
    seed: int = field(default=0, metadata={"help": "Seeds the tiny models, the data and the response lengths."})
    rm_hidden_size: int = field(default=256, metadata={"help": "Hidden size of the demo RM (its cost per token)."})
    rm_layers: int = field(default=4, metadata={"help": "Layers of the demo RM."})
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Where the tiny models and data are built (default: $VERL_ASYNC_RM_CACHE, else "
                         "~/.cache/verl_async_rm; scripts/demo.sh sets it to the checkout's .cache/)."},
    )
    out_dir: str | None = field(
        default=None, metadata={"help": "Output folder (default: a fresh ./async_rm_demo/<timestamp>)."}
    )
    mode_timeout_s: float = field(default=900.0, metadata={"help": "Longest one mode's training run may take."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar on stderr."})

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "rollout_n", "response_length", "rm_hidden_size", "rm_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"demo {name}={value!r}: must be an integer >= 1, e.g. --{name.replace('_', '-')} 2")
        if self.rollout_n < 2:
            raise ValueError(f"demo rollout_n={self.rollout_n}: GRPO needs at least 2 responses per prompt, e.g. "
                             "--rollout-n 4")
        if self.rm_hidden_size % 64:
            raise ValueError(f"demo rm_hidden_size={self.rm_hidden_size}: must be a multiple of 64 (heads of 64, "
                             "which vLLM's CPU attention accepts), e.g. 256")
        for name in ("median_tokens", "sigma", "lr", "mode_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"demo {name}={value!r}: must be a finite number > 0")
        if self.trainer not in ("v1", "v0"):
            raise ValueError(f"demo trainer={self.trainer!r}: use v1 or v0, e.g. --trainer v0")
        self.mode_list()  # raises on an unknown mode

    def mode_list(self) -> tuple[str, ...]:
        """The modes to run, in :data:`ALL_MODES` order."""
        asked = {m.strip() for m in str(self.modes).split(",") if m.strip()}
        if asked == {"all"}:
            return ALL_MODES
        unknown = sorted(asked - set(ALL_MODES))
        if unknown or not asked:
            raise ValueError(f"demo modes={self.modes!r}: unknown {unknown or 'empty'}; pick from "
                             f"{', '.join(ALL_MODES)} or 'all', e.g. --modes plugin,no_rm")
        return tuple(m for m in ALL_MODES if m in asked)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "modes": list(self.mode_list())}
