"""What every kind shares (:class:`Kind`: it builds an item's input, refuses what it cannot do at config time and
reads the engine's raw value into the item's score) and the outcome kind (sequence classification, the RM most users
run), base of the per-trajectory kinds. The score is read at the last valid token of the mask, not by
``pad_token_id`` (wrong when a real token equals it).

A kind reads its checkpoint's tokenizer when it is here (``model_path``); an RM at an endpoint without one gets
``rm_tokenizer=None``: its input is then the chat messages the server renders (:attr:`RMInput.messages`)."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from verl_async_rm.errors import ConfigValueError, NonFiniteScoreError
from verl_async_rm.request import GroupRequest, RMRequest, ScoreResult
from verl_async_rm.scoring.checkpoint import load_tokenizer
from verl_async_rm.scoring.inputs import (check_token_ids, conversation_for, prepare_input_ids, strip_trailing,
                                          tokenizers_match)
from verl_async_rm.scoring.markup import hide_markup, map_strings

__all__ = ["Kind", "OutcomeKind", "RMInput", "find_head", "policy_side", "estimate_tokens"]

#: What a kind scores: one trajectory, or (a group judge) one group of them.
ItemT = TypeVar("ItemT", RMRequest, GroupRequest)

logger = logging.getLogger(__name__)

_AUTO_HEADS = ("score", "v_head", "classifier")


@dataclass
class RMInput:
    """One item's RM input: its ids (None when nothing here tokenizes it: a server renders ``messages``), whether
    they were cut to ``max_length``, for a process RM the positions read (one per kept step), the response token where
    each kept step ends and the leading steps cut, for a judge whose reply is constrained the JSON schema its text must
    follow, and the chat messages it renders (judges; an RM at an endpoint)."""

    ids: list[int] | None
    truncated: bool = False
    reads: list[int] | None = None
    token_index: list[int] | None = None
    dropped: int = 0
    schema: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None

    @property
    def num_tokens(self) -> int:
        """Its tokens: counted when tokenized here, else estimated from the messages' text."""
        if self.ids is not None:
            return len(self.ids)
        return estimate_tokens("".join(str(m.get("content", "")) for m in self.messages or ()))


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` when no tokenizer is at hand: about one per three characters, rounded up (a server's usage
    corrects the rate limits' count)."""
    return len(text) // 3 + 8


class Kind(Generic[ItemT]):
    """What every kind shares: the RM's limits and the policy's side (its tokenizer, the ids that end a response).
    A subclass implements :meth:`build` and :meth:`read`, and may refuse settings in :meth:`check`."""

    name = "kind"
    #: True: the conversation is always rendered as text for the RM (else ``retemplate`` decides).
    renders = True
    #: True: only a vLLM engine runs this kind (no transformers model is loaded).
    needs_vllm = False
    head_name = "none"

    @staticmethod
    def check(config: Any) -> None:
        """Refuse, at config time, settings this kind cannot use (``ConfigValueError`` naming the key)."""

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int | None) -> None:
        self.config, self.rm_tokenizer, self.vocab_size = config, rm_tokenizer, vocab_size
        max_positions = getattr(text_config, "max_position_embeddings", None)
        self.max_length = config.max_length or max_positions
        if config.max_length and max_positions and config.max_length > max_positions:
            logger.warning("max_length=%d is more than the RM's max_position_embeddings=%d: longer inputs go beyond "
                           "the positions the RM was trained on", config.max_length, max_positions)
        self.policy_tokenizer, self.response_stop_ids, self.policy_id_limit = policy_side(config)
        self.retemplate = True
        #: Ids appended to every input (the reward token of InternLM2-style outcome RMs).
        self.suffix_ids: list[int] = []
        #: How a value (a response, a prompt, a reference) becomes content of the RM's input: its special tokens'
        #: strings hidden so that the tokenizer here reads them as text (an engine where a server tokenizes the text
        #: sets its own: :func:`~.markup.neutralize_markup`).
        self.escape: Callable[[str], str] = functools.partial(hide_markup, tokenizer=rm_tokenizer)

    def _require_chat_template(self) -> None:
        """``ConfigValueError`` unless the RM's tokenizer (here) has a chat template to render the conversation."""
        if self.rm_tokenizer is not None and not getattr(self.rm_tokenizer, "chat_template", None):
            raise ConfigValueError(
                "model_path", self.config.model_path,
                "the RM tokenizer has no chat template, so the conversation cannot be re-rendered for it (its "
                "tokenizer or template differs from the policy's, or the RM is a judge)",
                "give it one (chat_template in tokenizer_config.json, or a chat_template.jinja next to it); or, if "
                "the RM was trained on the policy's exact tokenizer and chat format, set retemplate='never' (verl: "
                "+async_rm.retemplate=never) to feed it the policy's token ids")

    def build(self, item: ItemT) -> RMInput:
        """The RM input of ``item`` (raises :class:`~verl_async_rm.errors.RewardInputError`)."""
        raise NotImplementedError

    def read(self, item: ItemT, value: Any, built: RMInput) -> ScoreResult:
        """The engine's raw value of ``item`` as its score, or the error that fails it."""
        raise NotImplementedError

    def transformers_readout(self, model: Any) -> dict[str, Any]:
        """What the transformers engine reads (a kind that runs on transformers)."""
        raise NotImplementedError

    def verify(self, engine: Any) -> None:
        """A check of the loaded engine (a judge's readout, say); nothing by default."""


class OutcomeKind(Kind[RMRequest]):
    """A sequence-classification RM: the conversation as the RM reads it (the policy's ids, or re-rendered with its
    chat template), one finite score each."""

    name = "outcome"
    renders = False

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int | None) -> None:
        super().__init__(config, rm_tokenizer, text_config, vocab_size)
        if rm_tokenizer is None:  # at an endpoint, no checkpoint here: the server renders the conversation
            return
        if self.renders or config.retemplate == "always":
            self.retemplate = True
        elif config.retemplate == "never":
            self.retemplate = False
            path = config.policy_tokenizer_path  # when given, its vocabulary must be the RM's
            if path and os.path.isdir(path):
                policy = load_tokenizer(path, "policy_tokenizer_path", config.trust_remote_code)
                if policy.get_vocab() != rm_tokenizer.get_vocab():
                    raise ConfigValueError(
                        "retemplate", "never", f"the RM's vocabulary ({config.model_path}) differs from the policy's "
                        f"({path}), so the policy's token ids would mean other text to the RM",
                        "use retemplate='auto' (the default): the conversation is re-rendered as text for the RM")
                if not tokenizers_match(policy, rm_tokenizer):
                    logger.warning("retemplate='never' with the same vocabulary but another chat template or BOS/EOS "
                                   "than the policy's: the RM reads the policy's ids in a format it was not trained on")
        else:
            self.retemplate = not tokenizers_match(self.policy_tokenizer, rm_tokenizer)
        if self.retemplate:
            self._require_chat_template()
        #: Ids appended to every input: the reward token of InternLM2-style RMs, whose score is read there.
        token = getattr(text_config, "reward_token_id", None)
        self.suffix_ids = [token] if isinstance(token, int) and not isinstance(token, bool) and \
            config.score_output_field is None else []

    def transformers_readout(self, model: Any) -> dict[str, Any]:
        """What the transformers engine reads: the head whose per-token output it indexes (or an output field)."""
        if self.config.score_output_field is not None:
            self.head_name = f"output.{self.config.score_output_field}"
            return {"head": None, "output_field": self.config.score_output_field}
        self.head_name, head = find_head(model, self.config.score_head)
        num_labels = int(model.config.num_labels)
        index = self.config.score_index
        if self.config.score_reduction == "index" and not -num_labels <= index < num_labels:
            raise ConfigValueError("score_index", index, f"the RM at {self.config.model_path} has {num_labels} "
                                   "output(s)", f"use an index in [{-num_labels}, {num_labels - 1}] or a "
                                   "score_reduction")
        return {"head": head}

    def build(self, request: RMRequest) -> RMInput:
        if self.rm_tokenizer is None:  # the conversation, with the response as the policy's tokenizer reads it
            if self.policy_id_limit is not None:
                check_token_ids(request, "response_ids", self.policy_id_limit, "the policy tokenizer's vocabulary")
            response = self.policy_tokenizer.decode(strip_trailing(request.response_ids, self.response_stop_ids),
                                                    skip_special_tokens=False)
            return RMInput(None, messages=map_strings(conversation_for(request, response), self.escape))
        ids, cut = prepare_input_ids(
            request, rm_tokenizer=self.rm_tokenizer, policy_tokenizer=self.policy_tokenizer,
            retemplate=self.retemplate, response_stop_ids=self.response_stop_ids, max_length=self.max_length,
            id_limit=self.policy_id_limit if self.retemplate else self.vocab_size, suffix_ids=self.suffix_ids)
        return RMInput(ids, cut)

    def read(self, request: RMRequest, value: Any, built: RMInput) -> ScoreResult:
        if not math.isfinite(value):
            return NonFiniteScoreError(f"trajectory {request.uid}: the RM returned {value}")
        return value


def policy_side(config: Any) -> tuple[Any, set[int], int | None]:
    """What reads the policy's responses (unless ``retemplate='never'``): its tokenizer, the ids that end a response
    (dropped before decoding: EOS and pad, and the EOS ids of its generation config) and one past the largest id it can
    generate: ``len(tokenizer)``, or the ``vocab_size`` of the model's ``config.json`` next to it when larger (embedding
    rows padded past the tokenizer decode to no text)."""
    if config.retemplate == "never":
        return None, set(), None
    path = config.policy_tokenizer_path
    tokenizer = load_tokenizer(path, "policy_tokenizer_path", config.trust_remote_code)
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
        stop_ids.update(eos if isinstance(eos, list) else [eos])
    except OSError:  # no generation_config.json next to the tokenizer
        pass
    limit = len(tokenizer)
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_config = json.load(f)
        sizes = [model_config.get("vocab_size"), (model_config.get("text_config") or {}).get("vocab_size")]
        limit = max([limit, *(v for v in sizes if isinstance(v, int))])
    except (OSError, ValueError, AttributeError):  # a tokenizer-only directory
        pass
    return tokenizer, {i for i in stop_ids if i is not None}, limit


def find_head(model: Any, name: str) -> tuple[str, Any]:
    """(name, module) of the head whose per-token output is read; (``"model logits"``, None) for none."""
    import torch

    if name == "none":
        return "model logits", None
    if name != "auto":
        head = getattr(model, name, None)
        if not isinstance(head, torch.nn.Module):
            raise ConfigValueError("score_head", name, f"the model {type(model).__name__} has no such module",
                                   "use 'auto', 'none', or the name of the head module (see print(model))")
        return name, head
    for candidate in _AUTO_HEADS:
        head = getattr(model, candidate, None)
        if isinstance(head, torch.nn.Module):
            return candidate, head
    logger.warning("no score head among %s on %s; using the model's own pooled logits", _AUTO_HEADS,
                   type(model).__name__)
    return "model logits", None

