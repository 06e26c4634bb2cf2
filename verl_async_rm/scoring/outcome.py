"""The outcome kind (sequence classification, the RM most users run), base of the other kinds: a kind builds a
trajectory's input, refuses what it cannot do (:meth:`OutcomeKind.check`, at config time) and reads its score. The
score is read at the last valid token of the mask, not by ``pad_token_id`` (wrong when a real token equals it)."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import ConfigValueError, NonFiniteScoreError
from verl_async_rm.request import RMRequest, ScoreResult
from verl_async_rm.scoring.checkpoint import load_tokenizer
from verl_async_rm.scoring.inputs import prepare_input_ids, tokenizers_match

__all__ = ["OutcomeKind", "RMInput", "find_head", "policy_side"]

logger = logging.getLogger(__name__)

_AUTO_HEADS = ("score", "v_head", "classifier")


@dataclass
class RMInput:
    """One trajectory's RM input: its ids, whether they were cut to ``max_length``, for a process RM the positions
    read (one per kept step), the response token where each kept step ends and the leading steps cut, and for a judge
    whose reply is constrained the JSON schema its text must follow."""

    ids: list[int]
    truncated: bool = False
    reads: list[int] | None = None
    token_index: list[int] | None = None
    dropped: int = 0
    schema: dict[str, Any] | None = None


class OutcomeKind:
    """A sequence-classification RM: the conversation as the RM reads it (the policy's ids, or re-rendered with its
    chat template), one finite score each."""

    name = "outcome"
    #: True: the conversation is always rendered as text for the RM (else ``retemplate`` decides).
    renders = False
    #: True: only a vLLM engine runs this kind (no transformers model is loaded).
    needs_vllm = False

    @staticmethod
    def check(config: Any) -> None:
        """Refuse, at config time, settings this kind cannot use (``ConfigValueError`` naming the key)."""

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int) -> None:
        self.config, self.rm_tokenizer, self.vocab_size = config, rm_tokenizer, vocab_size
        max_positions = getattr(text_config, "max_position_embeddings", None)
        self.max_length = config.max_length or max_positions
        if config.max_length and max_positions and config.max_length > max_positions:
            logger.warning("max_length=%d is more than the RM's max_position_embeddings=%d: longer inputs go beyond "
                           "the positions the RM was trained on", config.max_length, max_positions)
        self.policy_tokenizer, self.response_stop_ids, self.policy_id_limit = policy_side(config)
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
        if self.retemplate and not getattr(rm_tokenizer, "chat_template", None):
            raise ConfigValueError(
                "model_path", config.model_path,
                "the RM tokenizer has no chat template, so the conversation cannot be re-rendered for it (its "
                "tokenizer or template differs from the policy's)",
                "give it one (chat_template in tokenizer_config.json, or a chat_template.jinja next to it); or, if "
                "the RM was trained on the policy's exact tokenizer and chat format, set retemplate='never' (verl: "
                "+async_rm.retemplate=never) to feed it the policy's token ids")
        #: Ids appended to every input: the reward token of InternLM2-style RMs, whose score is read there.
        token = getattr(text_config, "reward_token_id", None)
        self.suffix_ids = [token] if isinstance(token, int) and not isinstance(token, bool) and \
            config.score_output_field is None else []

    def hf_readout(self, model: Any) -> dict[str, Any]:
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
        """The RM input of ``request`` (raises :class:`~verl_async_rm.errors.RewardInputError`)."""
        ids, cut = prepare_input_ids(
            request, rm_tokenizer=self.rm_tokenizer, policy_tokenizer=self.policy_tokenizer,
            retemplate=self.retemplate, response_stop_ids=self.response_stop_ids, max_length=self.max_length,
            id_limit=self.policy_id_limit if self.retemplate else self.vocab_size, suffix_ids=self.suffix_ids)
        return RMInput(ids, cut)

    def read(self, request: RMRequest, value: Any, built: RMInput) -> ScoreResult:
        """The engine's raw value of ``request`` as its score, or the error that fails it."""
        if not math.isfinite(value):
            return NonFiniteScoreError(f"trajectory {request.uid}: the RM returned {value}")
        return value

    def verify(self, engine: Any) -> None:
        """A check of the loaded engine (a judge's readout, say); nothing for an outcome RM."""


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

