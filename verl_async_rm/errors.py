"""Exceptions raised by verl_async_rm, one per failure kind: configuration mistakes (:class:`ConfigValueError`, a
``ValueError``) and failures at run time (:class:`AsyncRMError` and its subclasses)."""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["ConfigValueError", "ConfigTypeError", "JudgeVerdictError", "AsyncRMError", "BatcherClosedError",
           "BatcherCrashedError", "RequestTimeoutError", "BatchResultError", "NoReplicasError", "RewardModelError",
           "ReplicaLostError", "EngineDeadError", "ShardDesyncError", "RMServiceLostError", "TrajectoryDroppedError",
           "RMScoreError", "NonFiniteScoreError", "RewardInputError", "ResourcePoolError", "remote_cause",
           "EndpointError", "TokenLimitError", "EndpointClosedError"]


class ConfigValueError(ValueError):
    """Raised when a setting has a bad value; the message names the key, the value and the fix (``{key}`` in ``why``
    and ``fix`` becomes the key reported: the field's name, or the user's key after :meth:`renamed`)."""

    def __init__(self, key: str, value: Any, why: str, fix: str) -> None:
        self.key, self.value, self.why, self.fix = key, value, why, fix
        super().__init__(f"{key}={value!r}: {why.replace('{key}', key)}. Fix: {fix.replace('{key}', key)}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray rebuilds an exception from its pickle: keep the four parts (``args`` holds only the message)
        return (type(self), (self.key, self.value, self.why, self.fix))

    def renamed(self, key: str) -> ConfigValueError:
        """The same error, reported under ``key``."""
        return type(self)(key, self.value, self.why, self.fix)


class ConfigTypeError(ConfigValueError, TypeError):
    """Raised when a setting has a value of the wrong type (a word where a number goes...)."""


class AsyncRMError(RuntimeError):
    """Raised when any part of verl_async_rm fails at run time; base of every error below. It pickles with its
    ``__cause__`` (Python's own pickling drops it), so a failure crosses the Ray boundary with its type and cause."""

    def __reduce__(self) -> tuple[Any, ...]:
        cause = self.__cause__
        try:
            pickle.dumps(cause)
        except Exception:  # noqa: BLE001 - a cause that cannot travel stays behind; its text is in the log
            cause = None
        return (_rebuild, (type(self), self.args, cause, self.__dict__))


class BatcherClosedError(AsyncRMError):
    """Raised when a request is submitted to, or still pending in, a batcher (or a group judge's gate) that is being
    closed."""


class BatcherCrashedError(AsyncRMError):
    """Raised when the batching loop died while the request was pending; ``__cause__`` holds why."""

    @classmethod
    def from_cause(cls, name: str, cause: BaseException) -> BatcherCrashedError:
        err = cls(f"batcher {name!r}: the batching loop died while the request waited ({type(cause).__name__}: "
                  f"{cause}); it has restarted, so the request can be submitted again")
        err.__cause__ = cause
        return err


class RequestTimeoutError(AsyncRMError, TimeoutError):
    """Raised when a request's deadline passes before its result arrives, or its batch ran past
    ``batch_timeout_s``."""


class BatchResultError(AsyncRMError):
    """Raised when a batch function breaks its contract (for example returns a list of the wrong length)."""


class NoReplicasError(AsyncRMError):
    """Raised when every RM replica of a batcher is lost and none is being replaced."""


class RewardModelError(AsyncRMError):
    """Raised when the reward model fails to score a trajectory (load failure, forward failure)."""


class ReplicaLostError(RewardModelError):
    """Raised when an RM replica died, or stayed silent ``init_timeout_s`` after a timed-out call: its batch goes back
    to the queue (at most ``replica_retries`` times per request) and the replica is replaced, or retired."""


class ShardDesyncError(RewardModelError):
    """Raised on a rank of a sharded RM replica when a forward failed on some of its ranks but not on all: the ranks
    are out of step, so the replica ends, its batch re-queued and the replica replaced whole."""


class EngineDeadError(RewardModelError):
    """Raised in an RM replica whose vLLM engine is dead: no row is at fault, so the replica ends (batch re-queued,
    replica replaced)."""


class RMServiceLostError(AsyncRMError):
    """Raised in an agent-loop worker when the RM service died; the manager starts a new one at the next step."""


class TrajectoryDroppedError(RewardModelError):
    """Raised when more trajectories of a step lost their RM score than ``async_rm.drop_budget`` allows."""


class RMScoreError(RewardModelError):
    """Raised at the end of a v1 training step (or validation pass) in which a trajectory got no RM score while
    ``async_rm.on_error='raise'``; the message names the trajectories and their errors."""


class NonFiniteScoreError(RewardModelError):
    """Raised when the reward model returns NaN or an infinite score for a trajectory."""


class JudgeVerdictError(RewardModelError):
    """Raised for one trajectory when a judge RM's written verdict does not parse into a score (``judge_pattern``
    finds no match, or the match is neither a number nor one of ``judge_labels``), and for every member of a group
    when a group judge's reply is not a JSON object with a finite number for each label. ``reply``: the judge's text;
    ``reason``: why it does not read, in a few words (what a re-ask tells the judge)."""

    def __init__(self, message: str, *, reply: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.reply, self.reason = reply, reason


class RewardInputError(RewardModelError, ValueError):
    """Raised when a trajectory cannot be turned into reward-model input (missing ``raw_prompt``, empty text...)."""


class ResourcePoolError(AsyncRMError):
    """Raised when the reward pool's placement groups cannot be reserved (too few GPUs/CPUs, or a timeout)."""


def _rebuild(cls: type, args: tuple, cause: BaseException | None, state: dict) -> AsyncRMError:
    err = cls(*args)
    err.__dict__.update(state)
    err.__cause__ = cause
    return err


def remote_cause(err: BaseException) -> BaseException:
    """The exception a Ray task raised where it ran (its own type and message), rather than Ray's wrapper of it."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


# ---------------------------------------------------------------------------------------------------- remote RMs


class EndpointError(RewardModelError):
    """Raised when a remote RM endpoint fails one request: it refused it with a status that is not retried (a 4xx
    other than 408/429, or a redirect), or its answer is unusable; also the ``__cause__`` of the
    ``RequestTimeoutError`` of a request whose retries ran out of time (its last failure). ``endpoint``: the base URL
    that failed; ``status``: the HTTP status, None for a connection error or a bad body."""

    def __init__(self, message: str, *, endpoint: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.endpoint, self.status = endpoint, status


class TokenLimitError(RewardModelError):
    """Raised when one request needs more tokens (what it sends plus its max output tokens) than the tokens/min limit
    can ever hold: it could never be sent, so it fails at once instead of waiting."""


class EndpointClosedError(AsyncRMError):
    """Raised when a request is made to, or still in flight in, a remote endpoint client that is being closed."""
