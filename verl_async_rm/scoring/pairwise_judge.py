"""The pairwise judge (``reward_kind='pairwise_judge'``), one comparison at a time: a judge asked which of two
responses of a GRPO group is better. Its item is a :class:`~verl_async_rm.request.GroupRequest` of two members, in the
order shown: the first is response A, the second response B. The RM service plans a group's comparisons and turns
their answers into rewards (:mod:`verl_async_rm.service.pairs`, with the math of :mod:`.pairwise`).

``judge_prompt`` (Jinja) gets ``prompt``, ``messages``, ``ground_truth``, ``response_a`` and ``response_b``, each
content as in every judge's prompt (:func:`~.judge.as_content`: a tag of the prompt's structure in it escaped, a
special token's string kept text). A comparison reads, from the first position's point of view:

- ``judge_readout=logits`` (default): the first token's probabilities of the two ``judge_tokens`` (default
  ``[A, B]``): P(A wins) = p(A) / (p(A) + p(B)), one forward per ordered pair (transformers, or an endpoint's top
  log-probabilities);
- ``judge_readout=generate``: the reply is ``{"winner": "A"}``, ``{"winner": "B"}`` or ``{"winner": "tie"}``
  (constrained to that schema where the engine or server can; else the last JSON object in the text): 1, 0 or 0.5.
  A reply cut at ``judge_max_tokens`` is never read; one that does not read is asked again under ``judge_retries``."""

from __future__ import annotations

from typing import Any

from verl_async_rm.errors import ConfigValueError, JudgeVerdictError, NonFiniteScoreError
from verl_async_rm.request import GroupRequest, ScoreResult
from verl_async_rm.scoring.engine import Generated
from verl_async_rm.scoring.judge import (as_content, check_whole, compile_prompt, judge_input_ids, judge_messages,
                                         logits_readout, prompt_values, refuse_never, reply_room, response_text,
                                         verify_logits)
from verl_async_rm.scoring.outcome import Kind, RMInput
from verl_async_rm.scoring.pairwise import REPLY_FORM, parse_winner, winner_outcome, winner_schema

__all__ = ["PairwiseLogitsKind", "PairwiseGenerateKind", "PAIR_VARIABLES", "DEFAULT_PAIR_TOKENS"]

#: The variables of a pairwise judge's ``judge_prompt``.
PAIR_VARIABLES = ("prompt", "messages", "ground_truth", "response_a", "response_b")
DEFAULT_PAIR_TOKENS = ("A", "B")
_PAIR = (
    "Here is a question{% if ground_truth %}, a reference answer{% endif %} and two responses to it, A and B, each "
    "between tags.\n\n<question>\n{{ prompt }}\n</question>\n{% if ground_truth %}\n<reference_answer>\n"
    "{{ ground_truth }}\n</reference_answer>\n{% endif %}\n<response_a>\n{{ response_a }}\n</response_a>\n\n"
    "<response_b>\n{{ response_b }}\n</response_b>\n\nWhich response is better: first the more correct, then the "
    "more complete? "
)
DEFAULT_PROMPTS = {"logits": _PAIR + "Answer A or B.", "generate": _PAIR + REPLY_FORM[0].upper() + REPLY_FORM[1:] + "."}
#: Keys a pairwise judge has no use for, and why.
_REFUSED = {
    "judge_pattern": "a pairwise judge's reply is the JSON object {\"winner\": ...}, read as such",
    "judge_labels": "a pairwise judge's reply is the JSON object {\"winner\": ...}, read as such",
    "score_output_field": "a pairwise judge is read at its next token or from the JSON object it writes",
}


class PairwiseLogitsKind(Kind[GroupRequest]):
    """A comparison read at the judge's next token (see the module doc)."""

    name = "pairwise_judge"
    readout = "logits"

    @classmethod
    def check(cls, config: Any) -> None:
        """Keys it has no use for refused; the defaults filled in; ``judge_prompt`` compiled."""
        for key, why in _REFUSED.items():
            if getattr(config, key) is not None:
                raise ConfigValueError(key, getattr(config, key), why, "remove it")
        refuse_never(config)
        if cls.readout == "generate" and config.judge_tokens is not None:
            raise ConfigValueError("judge_tokens", config.judge_tokens, "it is read only with judge_readout=logits, "
                                   "and judge_readout is 'generate'", "remove it, or set judge_readout=logits")
        defaults = {"judge_prompt": DEFAULT_PROMPTS[cls.readout]}
        if cls.readout == "logits":
            defaults["judge_tokens"] = DEFAULT_PAIR_TOKENS
        for key, value in defaults.items():
            if getattr(config, key) is None:
                object.__setattr__(config, key, value)
        if cls.readout == "logits" and len(config.judge_tokens) != 2:
            raise ConfigValueError("judge_tokens", list(config.judge_tokens), "a pairwise judge's logits readout "
                                   "compares the probabilities of two tokens, one per response",
                                   "list two tokens, A's then B's, e.g. '[A,B]'")
        compile_prompt(config.judge_prompt, PAIR_VARIABLES)

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int | None) -> None:
        super().__init__(config, rm_tokenizer, text_config, vocab_size)
        self._require_chat_template()
        self.template = compile_prompt(config.judge_prompt, PAIR_VARIABLES)
        self.head_name = "final norm -> judge_tokens" if self.readout == "logits" else "generate -> winner"
        #: The input's tokens at most (a judge that writes needs room for its reply).
        self.room = reply_room(config, self.max_length) if self.readout == "generate" else self.max_length

    def messages(self, pair: GroupRequest) -> list[dict[str, str]]:
        """The judge's conversation for one ordered pair (A first), its values escaped (:attr:`Kind.escape`)."""
        first, second = pair.members
        texts = [as_content(response_text(m, policy_tokenizer=self.policy_tokenizer,
                                          response_stop_ids=self.response_stop_ids, id_limit=self.policy_id_limit),
                            self.escape) for m in (first, second)]
        text = self.template.render(response_a=texts[0], response_b=texts[1], **prompt_values(first, self.escape))
        return judge_messages(text, pair.reask, REPLY_FORM, escape=self.escape)

    def build(self, pair: GroupRequest) -> RMInput:
        if len(pair.members) != 2:
            raise ValueError(f"a pairwise judge compares two responses, got {len(pair.members)}")
        messages = self.messages(pair)
        schema = winner_schema() if self.readout == "generate" else None
        if self.rm_tokenizer is None:  # at an endpoint, no checkpoint here: the server renders them
            return RMInput(None, schema=schema, messages=messages)
        ids = judge_input_ids(messages, pair.uid, tokenizer=self.rm_tokenizer, max_length=self.room)
        return RMInput(ids, schema=schema, messages=messages)

    def read(self, pair: GroupRequest, value: Any, built: RMInput) -> ScoreResult:
        """P(A wins): the logits readout's probability, as the engine gives it (a value that is not one, a NaN from an
        overflowed forward say, is this comparison's error)."""
        value = float(value)
        if not 0.0 <= value <= 1.0:  # NaN fails both
            return NonFiniteScoreError(f"comparison {pair.uid}: the judge's readout gave P(A wins) = {value}")
        return value

    def transformers_readout(self, model: Any) -> dict[str, Any]:
        return logits_readout(self, model)

    def verify(self, engine: Any) -> None:
        verify_logits(self, engine)


class PairwiseGenerateKind(PairwiseLogitsKind):
    """A comparison the judge writes (vLLM, or an endpoint's chat completions; see the module doc)."""

    readout = "generate"
    needs_vllm = True

    def read(self, pair: GroupRequest, value: Generated, built: RMInput) -> ScoreResult:
        where = f"pairwise judge {self.config.model_path or self.config.endpoint}: {pair.uid}: "
        try:
            check_whole(value, self.config.judge_max_tokens, where)
            return winner_outcome(parse_winner(value.text))
        except JudgeVerdictError as err:
            return err
        except ValueError as err:
            shown = value.text[-300:]
            return JudgeVerdictError(f"{where}the judge's reply does not read: {err} (its end: {shown!r})",
                                     reply=value.text, reason=str(err))
