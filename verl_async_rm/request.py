"""What travels between an agent-loop worker and an RM replica: the request (:class:`RMRequest`), built once per
trajectory, and its result (:data:`ScoreResult`): the score (:data:`Score`), converted once in the replica from the
forward's tensor, or the typed error that kept it from being scored, a value on the whole way back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import AsyncRMError, RewardInputError

__all__ = ["RMRequest", "GroupRequest", "GroupVerdict", "Score", "ScoreResult", "StepRewards", "Verdict",
           "score_value"]


@dataclass
class RMRequest:
    """One trajectory to score; small and picklable, built once by the agent-loop worker.

    ``prompt_ids``/``response_ids``: the policy's unpadded ids (the response holds every turn after the prompt);
    ``raw_prompt``: the prompt's chat messages, to which a re-templating RM appends the decoded response; ``messages``:
    the whole conversation, rendered as is instead (needed by multi-turn trajectories that are re-templated); ``group``:
    verl's prompt ``uid`` (GRPO siblings); ``group_size``: how many siblings the rollout makes (``rollout.n``, or
    ``val_kwargs.n`` in validation; a group judge waits for them); ``ground_truth``: the dataset's answer, as text, for
    judges; ``reask``: a judge asked again, its previous reply and why it did not read (the judge sees both)."""

    uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    raw_prompt: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] | None = None
    num_turns: int = 2
    group: str | None = None
    ground_truth: str | None = None
    group_size: int | None = None
    reask: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self.uid = str(self.uid)
        self.prompt_ids = _token_list(self.prompt_ids, "prompt_ids", self.uid)
        self.response_ids = _token_list(self.response_ids, "response_ids", self.uid)
        self.raw_prompt = _message_list(self.raw_prompt, "raw_prompt", self.uid)
        self.messages = _message_list(self.messages, "messages", self.uid)
        self.num_turns = int(self.num_turns)
        if self.ground_truth is not None and not isinstance(self.ground_truth, str):
            self.ground_truth = str(self.ground_truth)  # verl's datasets hold numbers too (GSM8K: "72" or 72)
        if self.group_size is not None:
            self.group_size = int(self.group_size)

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length in policy tokens (what the batcher budgets with)."""
        return len(self.prompt_ids) + len(self.response_ids)

    @classmethod
    def from_agent_loop_output(cls, output: Any, *, uid: str, raw_prompt: Sequence[Mapping[str, Any]] | None,
                               messages: Sequence[Mapping[str, Any]] | None = None, group: str | None = None,
                               ground_truth: Any = None, group_size: int | None = None) -> RMRequest:
        """Build a request from a verl ``AgentLoopOutput`` (``prompt_ids``, ``response_ids``, ``num_turns``)."""
        return cls(uid=uid, prompt_ids=output.prompt_ids, response_ids=output.response_ids, raw_prompt=raw_prompt,
                   messages=messages, num_turns=output.num_turns or 2, group=group, ground_truth=ground_truth,
                   group_size=group_size)


@dataclass(frozen=True)
class GroupRequest:
    """Members of one GRPO group scored together: a group judge's call (the RM service's group gate builds it), or one
    comparison of a pairwise judge (two members, in the order shown: A, then B); and, when the judge is asked again,
    its previous reply and why it did not read."""

    group: str
    members: tuple[RMRequest, ...]
    reask: tuple[str, str] | None = None

    @property
    def uid(self) -> str:
        """How errors name it."""
        return f"group {self.group} ({len(self.members)} trajectories)"

    @property
    def num_tokens(self) -> int:
        """Policy tokens of every member (what the batcher budgets with)."""
        return sum(m.num_tokens for m in self.members)


@dataclass(frozen=True)
class GroupVerdict:
    """A group's judging, for one :class:`GroupRequest`: each member's score, or the error that kept that member from
    one (a pairwise judge's response left with no comparison), and the text kept with it, in the members' order."""

    scores: tuple[float | AsyncRMError, ...]
    texts: tuple[str, ...]


@dataclass(frozen=True)
class StepRewards:
    """A process RM's token-level reward (``process_reduction='none'``): a score per scored step, the response token
    where each step ends, and the leading steps ``max_length`` left unscored."""

    scores: tuple[float, ...]
    token_index: tuple[int, ...]
    dropped: int = 0

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.token_index):
            raise ValueError("StepRewards needs one token index per score")

    @property
    def total(self) -> float:
        """The trajectory's reward: the sum of its step rewards (what verl's ``rm_scores.sum(-1)`` gives)."""
        return sum(self.scores, 0.0)


@dataclass(frozen=True)
class Verdict:
    """A judge's score parsed from the text it wrote, and that text's end."""

    score: float
    text: str


#: One RM's score of one trajectory: a finite float, a token-level process RM's step rewards, or a judge's verdict.
Score = float | StepRewards | Verdict
#: What a kind makes of one item, from the replica to the agent-loop worker: a trajectory's score, a group judge's
#: :class:`GroupVerdict` for a :class:`GroupRequest` (which the service splits per member), or the error that kept it
#: from being scored (a value, never raised, so that each item fails alone).
ScoreResult = Score | GroupVerdict | AsyncRMError


def score_value(score: Score) -> float:
    """The trajectory-level value of a score."""
    if isinstance(score, StepRewards):
        return score.total
    return score.score if isinstance(score, Verdict) else score


def _token_list(ids: Any, name: str, uid: str) -> list[int]:
    if hasattr(ids, "tolist"):  # numpy array or torch tensor
        ids = ids.tolist()
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise RewardInputError(f"trajectory {uid}: {name} must be a list of token ids, got {type(ids).__name__}")
    try:
        return [int(t) for t in ids]
    except (TypeError, ValueError) as err:
        raise RewardInputError(f"trajectory {uid}: {name} must hold integer token ids ({err})") from None


def _message_list(messages: Any, name: str, uid: str) -> list[dict[str, Any]] | None:
    if messages is None:
        return None
    if hasattr(messages, "tolist"):  # verl keeps raw_prompt in numpy object arrays
        messages = messages.tolist()
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise RewardInputError(f"trajectory {uid}: {name} must be a list of chat messages, got {type(messages)}")
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise RewardInputError(f"trajectory {uid}: each {name} message needs a 'role', got {message!r}")
        out.append(dict(message))
    return out
