"""Exceptions raised by verl_async_rm, one per failure kind.

Configuration mistakes are reported as ``ValueError``/``TypeError`` (the message names the key, the bad value and the
fix); the classes below cover failures at run time. Every class derives from :class:`AsyncRMError` so callers can
catch the package's failures in one place.
"""

from __future__ import annotations

__all__ = [
    "AsyncRMError",
    "ExecutorClosedError",
    "ExecutorCrashedError",
    "QueueFullError",
    "RequestTimeoutError",
    "BatchResultError",
    "SlotError",
    "SlotLostError",
    "NoSlotsError",
    "take_slot_ready",
    "RewardModelError",
    "ReplicaError",
    "ReplicaLostError",
    "ReplicaTimeoutError",
    "ExecutorLostError",
    "TrajectoryDroppedError",
    "RMScoreError",
    "NonFiniteScoreError",
    "RewardInputError",
    "ResourcePoolError",
]


class AsyncRMError(RuntimeError):
    """Raised when any part of verl_async_rm fails at run time; base of every error below."""


class ExecutorClosedError(AsyncRMError):
    """Raised when a request is submitted to, or still pending in, an executor that is being closed."""


class ExecutorCrashedError(AsyncRMError):
    """Raised when the executor's batching loop died while the request was pending; ``__cause__`` holds why."""

    @classmethod
    def from_cause(cls, executor_name: str, cause: BaseException) -> ExecutorCrashedError:
        """The error handed to each request that was waiting when the loop of ``executor_name`` died of ``cause``."""
        err = cls(
            f"executor {executor_name!r}: the batching loop died while the request waited "
            f"({type(cause).__name__}: {cause}); it has restarted, so the request can be submitted again"
        )
        err.__cause__ = cause
        return err


class QueueFullError(AsyncRMError):
    """Raised when ``max_pending`` requests are already waiting and the overflow policy is ``reject``."""


class RequestTimeoutError(AsyncRMError, TimeoutError):
    """Raised when a request's deadline passes before its result arrives."""


class BatchResultError(AsyncRMError):
    """Raised when a batch function breaks its contract (for example returns a list of the wrong length)."""


class SlotError(AsyncRMError):
    """Raised by a batch function when its slot failed as a whole (the replica died, or did not answer in time).

    The executor does not bisect such a batch: re-running halves on a dead or stuck slot finds no culprit item.
    ``slot_ready``, when given, is an awaitable that completes when the slot is idle again (for example the RM call
    that is still running on a replica after a timeout): the executor gives the slot no new batch until then.
    """

    def __init__(self, *args: object, slot_ready: object = None) -> None:
        super().__init__(*args)
        self.slot_ready = slot_ready


def take_slot_ready(exc: BaseException) -> object:
    """Detach and return ``exc.slot_ready`` (None if absent), so the exception can be pickled to callers."""
    return exc.__dict__.pop("slot_ready", None)


class SlotLostError(SlotError):
    """Raised by a batch function when its slot is gone for good (the RM replica died).

    The executor retires the slot, puts the batch's requests back at the head of the queue for the other slots (at
    most ``BatchPolicy.slot_retries`` times per request) and asks for a replacement if it was given a way to make one.
    """


class NoSlotsError(AsyncRMError):
    """Raised when every slot (RM replica) of the executor is lost and none is being replaced."""


class RewardModelError(AsyncRMError):
    """Raised when the reward model fails to score a trajectory (load failure, forward failure)."""


class ReplicaError(SlotError, RewardModelError):
    """Raised when an RM replica died, raised on a whole batch, or did not answer within ``score_timeout_s``."""


class ReplicaLostError(ReplicaError, SlotLostError):
    """Raised when an RM replica died (its actor is gone); its batch is re-queued on the other replicas."""


class ReplicaTimeoutError(ReplicaError, RequestTimeoutError):
    """Raised when an RM replica did not answer a batch within ``score_timeout_s``."""


class ExecutorLostError(AsyncRMError):
    """Raised in an agent-loop worker when the executor actor died; the manager starts a new one at the next step."""


class TrajectoryDroppedError(RewardModelError):
    """Raised when more trajectories of a step lost their RM score than ``async_rm.drop_budget`` allows."""


class RMScoreError(RewardModelError):
    """Raised at the end of a v1 training step (or validation pass) in which a trajectory got no RM score while
    ``async_rm.on_error='raise'``; the message names the trajectories and their errors."""


class NonFiniteScoreError(RewardModelError):
    """Raised when the reward model returns NaN or an infinite score for a trajectory."""


class RewardInputError(RewardModelError, ValueError):
    """Raised when a trajectory cannot be turned into reward-model input (missing ``raw_prompt``, empty text...)."""


class ResourcePoolError(AsyncRMError):
    """Raised when the reward pool's placement groups cannot be reserved (too few GPUs/CPUs, or a timeout)."""
