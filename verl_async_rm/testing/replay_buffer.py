"""verl's replay buffers polling TransferQueue more often, through verl's own custom-sampler hook.

verl 0.9.1's ``ReplayBuffer`` waits ``poll_interval`` between looks at TransferQueue, 2 s by default, and
``PPOTrainer._build_replay_buffer`` passes no other value: a CPU step whose rollout takes a second still spends 2 s in
``gen``, and differences of less than 2 s between two runs disappear. verl lets a run name its own sampler class
(``trainer.v1.sampler.custom_sampler.{path,name}``, given ``trainer.v1.sampler.sampler_kwargs``); these are verl's
own classes with ``poll_interval_s`` read from ``sampler_kwargs`` (:func:`short_poll_overrides`). verl gives a custom
sampler only its base arguments: no group filtering (DAPO) and no ``sync_refill_failed_groups``, which runs that need
them leave to verl's own sampler.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

__all__ = ["POLL_INTERVAL_S", "ShortPollReplayBuffer", "ShortPollReplayBufferAsync", "short_poll_overrides"]

#: The polling period these samplers use unless ``sampler_kwargs.poll_interval_s`` says otherwise.
POLL_INTERVAL_S = 0.05


def _poll_interval(sampler_kwargs: Any) -> float:
    value = (sampler_kwargs or {}).get("poll_interval_s", POLL_INTERVAL_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"trainer.v1.sampler.sampler_kwargs.poll_interval_s={value!r}: must be a number of seconds "
                         f"> 0, e.g. {POLL_INTERVAL_S}")
    return float(value)


class ShortPollReplayBuffer(ReplayBuffer):
    """verl's sync-mode ``ReplayBuffer`` polling every ``sampler_kwargs.poll_interval_s`` seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.poll_interval = _poll_interval(self.sampler_kwargs)


class ShortPollReplayBufferAsync(ReplayBufferAsync):
    """verl's ``ReplayBufferAsync`` (colocate_async, separate_async) polling every ``poll_interval_s`` seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.poll_interval = _poll_interval(self.sampler_kwargs)


def short_poll_overrides(trainer_mode: str = "sync", poll_interval_s: float = POLL_INTERVAL_S,
                         cls: type | None = None) -> list[str]:
    """Hydra overrides that make verl's trainer build ``cls`` (default: the short-poll class for ``trainer_mode``)."""
    if cls is None:
        cls = ShortPollReplayBuffer if trainer_mode == "sync" else ShortPollReplayBufferAsync
    return [
        f"trainer.v1.sampler.custom_sampler.path=pkg://{cls.__module__}",
        f"trainer.v1.sampler.custom_sampler.name={cls.__name__}",
        f"+trainer.v1.sampler.sampler_kwargs.poll_interval_s={poll_interval_s}",
    ]
