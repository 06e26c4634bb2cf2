"""The judge kinds (``reward_kind='judge'``): a causal LM asked about the trajectory in ``judge_prompt`` (Jinja, the
user turn of its chat template), read at its next token (``logits``, transformers, :class:`~.readout.JudgeLogits`,
checked at load against the model's own logits) or by the verdict it writes (``generate``, vLLM, parsed by
``judge_pattern``; a verdict that does not parse fails its trajectory, never a default score).

The values the prompt renders (``prompt``, ``response``, ``ground_truth``, ``messages``) are content
(:func:`as_content`): whatever they hold, the judge reads it as text, inside the prompt's structure. The default
prompts put the question, the reference answer and the response each between tags of their own (``<question>``,
``<reference_answer>``, ``<response>``), and a tag of those names in a value is escaped
(:func:`~.markup.escape_tags`), so a response cannot close its section or write another. Locally a special token's
string in a value stays text (:func:`~.markup.hide_markup`, then :func:`chat_ids`); the text of ``judge_prompt`` itself
is the user's, and its special tokens are control tokens."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from verl_async_rm.errors import ConfigValueError, JudgeVerdictError, RewardInputError
from verl_async_rm.request import RMRequest, ScoreResult, Verdict
from verl_async_rm.scoring.engine import Generated, check_rows, differs
from verl_async_rm.scoring.inputs import check_token_ids, dedup_bos, strip_trailing
from verl_async_rm.scoring.markup import HIDDEN, escape_tags, map_strings, markup_ids
from verl_async_rm.scoring.outcome import OutcomeKind, RMInput

__all__ = ["JudgeLogitsKind", "JudgeGenerateKind", "Verdict", "compile_prompt", "compile_pattern", "judge_text",
           "response_text", "as_content", "prompt_values", "judge_messages", "verdict_form", "judge_input_ids",
           "chat_ids", "last_user_text", "parse_verdict", "judge_token_ids", "final_norm", "VERDICT_CHARS",
           "check_whole", "logits_readout", "verify_logits", "reply_room", "refuse_never"]

# each part between tags of its own: a response cannot write the reference's section or another part's
# (as_content escapes those tags in it), and the instruction comes last, where the judge reads it before it answers
_QUESTION = (
    "Here is a question{% if ground_truth %}, a reference answer{% endif %} and a response to it, each between "
    "tags.\n\n<question>\n{{ prompt }}\n</question>\n{% if ground_truth %}\n<reference_answer>\n{{ ground_truth }}\n"
    "</reference_answer>\n{% endif %}\n<response>\n{{ response }}\n</response>\n\n"
)
DEFAULT_PROMPTS = {
    "logits": _QUESTION + "Is the response correct? Answer Yes or No.",
    "generate": _QUESTION + "Grade the response from 0 (wrong) to 10 (correct). Explain briefly, then end with "
    "'Verdict: <grade>'.",
}
DEFAULT_TOKENS = ("Yes", "No")
DEFAULT_PATTERN = r"Verdict:\s*(-?[0-9]+(?:\.[0-9]+)?)"
#: Characters of a written verdict kept in ``reward_extra_info`` (its end, where the verdict is).
VERDICT_CHARS = 300
_VARIABLES = ("prompt", "response", "messages", "ground_truth")


def compile_prompt(text: str, variables: Sequence[str] = _VARIABLES, key: str = "judge_prompt") -> Any:
    """``judge_prompt`` as a sandboxed Jinja template that refuses unknown variables; ``ConfigValueError`` naming
    ``key`` when it does not parse or uses a variable other than ``variables`` (a per-response judge's: prompt,
    response, messages, ground_truth)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    fix = f"write it in Jinja with the variables {', '.join(variables)}, e.g. 'Question: {{{{ prompt }}}}'"
    samples = {"prompt": "p", "response": "r", "responses": '<response label="1">\nr\n</response>',
               "messages": [{"role": "user", "content": "p"}], "ground_truth": "g", "response_a": "a",
               "response_b": "b"}
    try:
        template = env.from_string(text)
        template.render(**{name: samples[name] for name in variables})
    except jinja2.TemplateError as err:
        raise ConfigValueError(key, text, f"{type(err).__name__}: {err}", fix) from None
    return template


def compile_pattern(text: str) -> re.Pattern[str]:
    """``judge_pattern`` compiled; ``ConfigValueError`` naming it unless it is a valid expression with one group."""
    try:
        pattern = re.compile(text)
    except re.error as err:
        raise ConfigValueError("judge_pattern", text, f"not a regular expression ({err})",
                               r"e.g. 'Verdict:\s*([0-9]+)'") from None
    if pattern.groups != 1:
        raise ConfigValueError(
            "judge_pattern", text, f"it has {pattern.groups} groups; the verdict is read from exactly one",
            r"put the verdict in one group and make the others non-capturing (?:...), e.g. 'Verdict:\s*([0-9]+)'")
    return pattern


def response_text(request: RMRequest, *, policy_tokenizer: Any, response_stop_ids: Iterable[int],
                  id_limit: int | None) -> str:
    """A trajectory's response as a reader sees it: decoded by the policy's tokenizer, special tokens skipped, its
    trailing stop ids dropped; ``RewardInputError`` when the judge has no question to put it under (no
    ``raw_prompt``) or an id is outside the policy's vocabulary."""
    if not request.raw_prompt:
        raise RewardInputError(
            f"trajectory {request.uid}: raw_prompt is missing; the judge's prompt needs the question as text. verl's "
            "RLHFDataset always provides it: a custom dataset or agent loop must keep the prompt's chat messages "
            "under 'raw_prompt'")
    if id_limit is not None:
        check_token_ids(request, "response_ids", id_limit, "the policy tokenizer's vocabulary")
    return policy_tokenizer.decode(strip_trailing(request.response_ids, response_stop_ids), skip_special_tokens=True)


def judge_text(request: RMRequest, *, template: Any, policy_tokenizer: Any, response_stop_ids: Iterable[int],
               id_limit: int | None, escape: Callable[[str], str] | None = None) -> str:
    """``judge_prompt`` rendered for one trajectory: the user turn the judge reads (the response as
    :func:`response_text` gives it), every value content (:func:`as_content`, with ``escape``)."""
    response = response_text(request, policy_tokenizer=policy_tokenizer, response_stop_ids=response_stop_ids,
                             id_limit=id_limit)
    return template.render(response=as_content(response, escape), **prompt_values(request, escape))


def as_content(text: str, escape: Callable[[str], str] | None = None) -> str:
    """A value as a judge's prompt renders it: its structure tags escaped (:func:`~.markup.escape_tags`), then
    ``escape`` applied: locally :func:`~.markup.hide_markup` for the judge's tokenizer (:func:`chat_ids` reads its
    special-token strings as text), at an endpoint :func:`~.markup.neutralize_markup`. Benign text is unchanged. The
    mark :func:`~.markup.hide_markup` writes (:data:`~.markup.HIDDEN`, a noncharacter) is dropped from the text first:
    else a tag split by it would pass the escape and be rejoined when the marks are removed."""
    text = escape_tags(text.replace(HIDDEN, ""))
    return text if escape is None else escape(text)


def prompt_values(request: RMRequest, escape: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The values of a judge's prompt besides the response(s), each content (:func:`as_content`): ``prompt`` (the
    last user turn of ``raw_prompt``), ``messages`` (``raw_prompt``, every string but the roles) and ``ground_truth``
    (empty when there is none)."""
    content = functools.partial(as_content, escape=escape)
    messages = request.raw_prompt
    return {"prompt": content(last_user_text(messages or [])),
            "messages": None if messages is None else map_strings(messages, content),
            "ground_truth": content("" if request.ground_truth is None else request.ground_truth)}


def judge_messages(text: str, reask: tuple[str, str] | None, form: str,
                   escape: Callable[[str], str] | None = None) -> list[dict[str, str]]:
    """The judge's conversation: ``text`` as its user turn; for a re-ask (``reask``: its previous reply and why it did
    not read), that reply as the assistant's turn and a user turn saying why and what ``form`` the answer must take.
    ``escape`` (as in :func:`as_content`) applies to the reply and the reason, which may quote what a response wrote."""
    messages = [{"role": "user", "content": text}]
    if reask is not None:
        reply, reason = reask
        if escape is not None:
            reply, reason = escape(reply), escape(reason)
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Your reply could not be read: {reason}. Answer again; {form}."}]
    return messages


def verdict_form(pattern: re.Pattern[str], labels: Mapping[str, float] | None) -> str:
    """What a re-ask tells a per-response judge its verdict must look like."""
    words = f", one of {', '.join(labels)}" if labels else ", a number"
    return f"the verdict must match the regular expression {pattern.pattern}{words}"


def judge_input_ids(messages: Sequence[Mapping[str, Any]], uid: str, *, tokenizer: Any,
                    max_length: int | None) -> list[int]:
    """The judge's input ids for ``messages`` (its chat template with the generation prompt). ``RewardInputError``
    naming ``uid`` when they are longer than ``max_length`` (cutting them would cut the judge's instructions or its
    generation prompt)."""
    ids = chat_ids(messages, tokenizer)
    if max_length is not None and len(ids) > max_length:
        raise RewardInputError(
            f"{uid}: the judge's input is {len(ids)} tokens, more than max_length={max_length} (a judge's input is "
            "never cut: that would cut its instructions). Fix: raise max_length, or shorten judge_prompt or the "
            "response length")
    return ids


def chat_ids(messages: Sequence[Mapping[str, Any]], tokenizer: Any) -> list[int]:
    """``messages`` in the tokenizer's chat template with its generation prompt, as token ids (one BOS): the special
    tokens the template and the messages' own text write are control tokens, content hidden by
    :func:`~.markup.hide_markup` is text (:func:`~.markup.markup_ids`)."""
    rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return dedup_bos(markup_ids(rendered, tokenizer), tokenizer.bos_token_id)


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, Sequence):  # multi-part content: its text parts
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def parse_verdict(text: str, pattern: re.Pattern[str], labels: Mapping[str, float] | None, where: str = "") -> float:
    """The score in a judge's text: the last match of ``pattern``'s group, as a number or one of ``labels`` (as
    written, then ignoring case). ``JudgeVerdictError`` (``where``, then the text's end; ``reply``: the text) when
    there is none or it is not finite."""
    matches = list(pattern.finditer(text))
    end = text[-200:]

    def failed(reason: str, ends: str = "the judge's text ends") -> JudgeVerdictError:
        return JudgeVerdictError(f"{where}{reason} ({ends}: {end!r})", reply=text, reason=reason)

    if not matches:
        raise failed(f"no match of judge_pattern {pattern.pattern!r} in the judge's text", "its end")
    verdict = (matches[-1].group(1) or "").strip()
    if labels:
        folded = {k.casefold(): v for k, v in labels.items()}
        value = labels.get(verdict, folded.get(verdict.casefold()))
        if value is None:
            raise failed(f"the verdict {verdict!r} is not one of judge_labels {sorted(labels)}")
        return float(value)
    try:
        value = float(verdict)
    except ValueError:
        raise failed(f"the verdict {verdict!r} is not a number and no judge_labels are set") from None
    if not math.isfinite(value):
        raise failed(f"the verdict {verdict!r} is not a finite number")
    return value


class JudgeLogitsKind(OutcomeKind):
    """A judge read at its next token: one transformers forward of its prompt, the judge tokens' logits read."""

    name = "judge"
    renders = True
    readout = "logits"

    @classmethod
    def check(cls, config: Any) -> None:
        """The judge keys checked, those of the other readout refused, and the defaults filled in."""
        refuse_never(config)
        refusals = {
            "score_output_field": (config.score_output_field is not None, "a judge is read at its next token or "
                                   "from its written verdict", "remove score_output_field"),
        }
        for key in ("judge_tokens",) if cls.readout == "generate" else ("judge_pattern", "judge_labels"):
            other = "logits" if key == "judge_tokens" else "generate"
            refusals[key] = (getattr(config, key) is not None, f"it is read only with judge_readout={other}, and "
                             f"judge_readout is {config.judge_readout!r}", "remove it, or set judge_readout")
        for key, (bad, why, fix) in refusals.items():
            if bad:
                raise ConfigValueError(key, getattr(config, key), why, fix)
        # the defaults of this readout's keys, where the user set none
        own = {"judge_tokens": DEFAULT_TOKENS} if cls.readout == "logits" else {"judge_pattern": DEFAULT_PATTERN}
        for key, value in {"judge_prompt": DEFAULT_PROMPTS[cls.readout], **own}.items():
            if getattr(config, key) is None:
                object.__setattr__(config, key, value)
        compile_prompt(config.judge_prompt)
        if cls.readout == "generate":
            compile_pattern(config.judge_pattern)

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int | None) -> None:
        super().__init__(config, rm_tokenizer, text_config, vocab_size)
        self.suffix_ids = []
        self.template = compile_prompt(config.judge_prompt)
        self.room = self.max_length  # the input's tokens at most

    def transformers_readout(self, model: Any) -> dict[str, Any]:
        return logits_readout(self, model)

    def messages(self, request: RMRequest) -> list[dict[str, str]]:
        """The judge's conversation for ``request`` (:func:`judge_messages`; a re-ask is a generate judge's), its
        its values escaped (:attr:`~.outcome.Kind.escape`)."""
        text = judge_text(request, template=self.template, policy_tokenizer=self.policy_tokenizer,
                          response_stop_ids=self.response_stop_ids, id_limit=self.policy_id_limit, escape=self.escape)
        return judge_messages(text, request.reask, self.form, escape=self.escape)

    @property
    def form(self) -> str:
        """What a re-ask says the answer must look like (a logits judge is never asked again)."""
        return ""

    def build(self, request: RMRequest) -> RMInput:
        messages = self.messages(request)
        if self.rm_tokenizer is None:  # at an endpoint, no checkpoint here: the server renders them
            return RMInput(None, messages=messages)
        return RMInput(judge_input_ids(messages, f"trajectory {request.uid}", tokenizer=self.rm_tokenizer,
                                       max_length=self.room), messages=messages)

    def verify(self, engine: Any) -> None:
        verify_logits(self, engine)


class JudgeGenerateKind(JudgeLogitsKind):
    """A judge that writes its verdict (vLLM, greedy, at most ``judge_max_tokens``), parsed into the score."""

    readout = "generate"
    needs_vllm = True

    def __init__(self, config: Any, rm_tokenizer: Any, text_config: Any, vocab_size: int | None) -> None:
        super().__init__(config, rm_tokenizer, text_config, vocab_size)
        self.head_name = "generate -> judge_pattern"
        self.pattern = compile_pattern(config.judge_pattern)
        self.labels = dict(config.judge_labels or ())
        self.room = reply_room(config, self.max_length)  # the verdict must fit in the engine's context too

    @property
    def form(self) -> str:
        return verdict_form(self.pattern, self.labels)

    def read(self, request: RMRequest, value: Generated, built: RMInput) -> ScoreResult:
        where = f"judge {self.config.model_path or self.config.endpoint}: trajectory {request.uid}: "
        try:
            check_whole(value, self.config.judge_max_tokens, where)
            return Verdict(parse_verdict(value.text, self.pattern, self.labels, where), value.text[-VERDICT_CHARS:])
        except JudgeVerdictError as err:
            return err


def reply_room(config: Any, max_length: int | None) -> int | None:
    """The input's tokens at most for a judge that writes: ``max_length`` less ``judge_max_tokens`` (None without a
    ``max_length``); ``ConfigValueError`` when the reply would not fit."""
    if max_length is None:
        return None
    if max_length <= config.judge_max_tokens:
        raise ConfigValueError("judge_max_tokens", config.judge_max_tokens, f"the judge's context is max_length="
                               f"{max_length} tokens, which must hold its input and its reply", "set judge_max_tokens "
                               "below max_length (or raise max_length)")
    return max_length - config.judge_max_tokens


def refuse_never(config: Any) -> None:
    """``retemplate='never'`` refused: a judge reads its own prompt."""
    if config.retemplate == "never":
        raise ConfigValueError("retemplate", "never", "a judge always reads its own prompt, rendered with its chat "
                               "template", "use retemplate='auto' (the default)")


def check_whole(reply: Generated, max_tokens: int, where: str) -> None:
    """``JudgeVerdictError`` (its ``reply`` and ``reason`` set, so the judge may be asked again) when ``reply`` stopped
    at its token limit: a cut reply is never read (it may end in the middle of its verdict, or hold only an example
    the judge echoed)."""
    if reply.finish_reason == "length":
        reason = (f"it was cut at the limit of judge_max_tokens={max_tokens} tokens before it ended; answer "
                  "shorter")
        raise JudgeVerdictError(f"{where}the judge's reply was cut at judge_max_tokens={max_tokens} (raise "
                                f"judge_max_tokens, or ask for a shorter reply in judge_prompt); its end: "
                                f"{reply.text[-200:]!r}", reply=reply.text, reason=reason)


def judge_token_ids(tokenizer: Any, strings: Sequence[str], vocab_size: int, path: str) -> list[int]:
    """The ids of ``judge_tokens``; ``ConfigValueError`` naming it unless each is one token of the judge."""
    ids = []
    for text in strings:
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1 or not 0 <= encoded[0] < vocab_size:
            raise ConfigValueError(
                "judge_tokens", list(strings),
                f"the judge's tokenizer ({path}) reads {text!r} as {len(encoded)} tokens {encoded}, so there is no "
                "one next-token logit to read for it",
                "list strings that are single tokens of the judge's vocabulary (with a leading space where its "
                "tokenizer writes one, e.g. ' Yes'); tokenizer.tokenize(text) shows how it splits")
        ids.append(int(encoded[0]))
    if len(set(ids)) != len(ids):
        raise ConfigValueError("judge_tokens", list(strings), f"they map to repeated token ids {ids}",
                               "list distinct tokens")
    return ids


def final_norm(model: Any) -> Any:
    """The module whose output the LM head reads (the decoder's final norm); ``ConfigValueError`` if not found."""
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        module = getattr(decoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ConfigValueError(
        "judge_readout", "logits", f"{type(model).__name__} has no final norm the plugin knows (norm, ln_f, ...) to "
        "read the hidden state its LM head reads", "use judge_readout='generate'")


def logits_readout(kind: Any, model: Any) -> dict[str, Any]:
    """What the transformers engine reads for a judge read at its next token (``kind``: a judge's or a pairwise
    judge's): the final norm's output through the LM head's rows of ``judge_tokens``."""
    import inspect

    from verl_async_rm.scoring.readout import JudgeLogits

    kind.head_name = "final norm -> judge_tokens"
    kind.token_ids = judge_token_ids(kind.rm_tokenizer, kind.config.judge_tokens, kind.vocab_size,
                                     kind.config.model_path)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    return {"head": final_norm(model), "transform": JudgeLogits(model, kind.token_ids), "forward_kwargs": keep}


def verify_logits(kind: Any, engine: Any) -> None:
    """The readout of :func:`logits_readout` must give what the model's own next-token logits give, on the load-time
    rows; else ``ConfigValueError`` (an output scaling the plugin does not know)."""
    import torch

    from verl_async_rm.scoring.packing import pack_rows

    rows = check_rows(kind.vocab_size, (9, 4, 6))
    got = [float(engine.forward_ids([ids])[0]) for ids in rows]
    reference = []
    with torch.no_grad():
        for ids in rows:
            kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids], device=engine.device)}
            if engine.kernel == "varlen":  # the model's attention is the packed kernel now
                packed = pack_rows([ids], engine.device)
                kwargs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                          **packed.varlen_kwargs()}
            chosen = engine.model(**kwargs, use_cache=False).logits[0, -1].float()[kind.token_ids]
            reference.append(float(chosen[0] if len(chosen) == 1 else torch.softmax(chosen, dim=-1)[0]))
    half = next(engine.model.parameters()).dtype in (torch.bfloat16, torch.float16)
    problem = differs(got, reference, half, f"reading {type(engine.model).__name__} at its final norm gives")
    if problem is not None:
        raise ConfigValueError("judge_readout", "logits", f"{problem}, its own next-token logits (an output "
                               "scaling the plugin does not apply)", "use judge_readout='generate'")
