"""``BatchPolicy``: when the executor flushes a batch, how big it may be, and what happens under overload."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_async_rm.options import check_options, option

__all__ = ["BatchPolicy", "OVERFLOW_MODES"]

#: What ``submit`` does when ``max_pending`` requests are already waiting.
OVERFLOW_MODES = ("block", "reject")


@dataclass(frozen=True)
class BatchPolicy:
    """How the pending-request executor forms batches.

    A batch is formed only when a slot (an RM replica, or the whole sharded RM) is free, and then only if one of these
    holds: ``max_batch_size`` requests are pending; ``max_batch_tokens`` tokens are pending; the OLDEST pending request
    has waited ``max_wait_ms``; or a drain (``drain()`` / ``expect(n)``) covers the oldest request.
    """

    max_batch_size: int = option(
        32,
        "Most requests in one batch_fn call; a batch this full is flushed at once.",
        least=1, fix="set it to the most requests one RM call should score, for example 64",
    )
    max_batch_tokens: int | None = option(
        None,
        "Most tokens (sum of each request's num_tokens) in one batch; None disables the budget. "
        "A request larger than the budget is sent alone. When set, every submit must give num_tokens.",
        int, optional=True, least=1,
        fix="set it to the token budget of one RM call (for example 65536), or None to disable the budget",
    )
    max_wait_ms: float = option(
        20.0,
        "Flush once the OLDEST pending request has waited this long (and a slot is free). "
        "0 makes the executor work-conserving: any free slot takes whatever is pending.",
        least=0,
        fix="set it to how long the oldest request may wait for a batch to fill (ms), for example 20",
    )
    max_pending: int | None = option(
        None,
        "Most requests waiting for a batch (not counting running ones); None means unbounded.",
        int, optional=True, least=1,
        fix="set it to the most requests allowed to wait (for example 65536), or None for no bound",
    )
    overflow: str = option(
        "block",
        "When max_pending requests are waiting: 'block' makes submit wait for room, 'reject' raises "
        "QueueFullError at once.",
        choices=OVERFLOW_MODES,
        fix="use 'block' to make submit wait for room or 'reject' to raise QueueFullError at once",
    )
    default_deadline_s: float | None = option(
        None,
        "Deadline, in seconds from submit, for requests that give none; None means no deadline. "
        "A request past its deadline fails with RequestTimeoutError, whether it is waiting or running.",
        float, optional=True, above=0, fix="give a positive number of seconds, or None for no limit",
    )
    batch_timeout_s: float | None = option(
        None,
        "Fail the requests of a batch_fn call that runs longer than this with RequestTimeoutError and "
        "cancel the call; its slot takes no new batch until the call has ended. None lets a call run as long "
        "as it needs.",
        float, optional=True, above=0, fix="give a positive number of seconds, or None for no limit",
    )
    group_by_length: bool = option(
        True,
        "When more requests are pending than fit in one batch, fill the batch (after the oldest request, "
        "always taken) with those closest in num_tokens to it, overdue ones first, from a window after the "
        "oldest, to cut padding; False: strict arrival order.",
    )
    prefer_siblings: bool = option(
        False,
        "With group_by_length: fill the batch with the oldest request's pending siblings (same group: "
        "the GRPO responses to its prompt, RMRequest.group) before the closest lengths, within the same window "
        "and due requests first, so a packed RM with share_prompts computes their prompt once. Costs padding "
        "for a padded RM: keep False there.",
    )
    slot_retries: int = option(
        2,
        "How many times a request whose slot was lost under it (the RM replica died) is put back in the "
        "queue for another slot; after that it fails with the slot's error.",
        least=0, fix="use 0 to fail at once, or a small count such as 2",
    )

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def max_wait_s(self) -> float:
        """``max_wait_ms`` in seconds."""
        return self.max_wait_ms / 1000.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | BatchPolicy | None) -> BatchPolicy:
        """A policy from a mapping of its fields (a policy passes through, None gives the defaults); unknown keys
        raise ``ValueError`` listing the known ones."""
        if values is None:
            return cls()
        if isinstance(values, cls):
            return values
        if not isinstance(values, Mapping):
            raise TypeError(f"expected a BatchPolicy or a mapping of its fields, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ValueError(f"unknown BatchPolicy field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**{str(k): v for k, v in values.items()})

    def to_dict(self) -> dict[str, Any]:
        """The policy as a plain dict (JSON-serialisable, accepted by :meth:`from_mapping`)."""
        return dataclasses.asdict(self)

