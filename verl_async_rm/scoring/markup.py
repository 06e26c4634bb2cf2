"""Content that never becomes markup: whatever a prompt, a response or a reference holds reaches an RM or a judge as
text, never as a control token of its chat format, nor as the structure of a judge's prompt.

Special tokens, locally. The RM's or judge's input holds exactly the special tokens its templates write (the chat
template, and the text of ``judge_prompt`` itself). Each piece of content goes through :func:`hide_markup` (or
:func:`hide_messages`): every special-token string in it gets a mark (U+FDD0, a Unicode noncharacter, reserved for a
program's internal use) after its first character, so neither the template nor the tokenizer sees it whole. The
template renders the conversation, and :func:`markup_ids` tokenizes it: the special-token strings left whole (the
templates' own) as control tokens, the text between them, marks removed, without special-token parsing
(``split_special_tokens=True``), as the tokenizer itself tokenizes the text between two special tokens.

Special tokens, at an endpoint. The server tokenizes the text it is sent with special-token parsing, so
:func:`neutralize_markup` breaks each marker for good: a space after its first character
(``<|im_end|>`` becomes ``< |im_end|>``). A space, not an invisible joiner: a server's normalizer may drop format
characters (BERT-style ``clean_text`` removes category Cf) before it matches tokens, none drops a space inside a
word; and a reader, human or LLM, still reads the same words. The markers are the judge's tokenizer's special-token
strings when it is at hand (``model_path``), else :data:`COMMON_MARKERS`.

A judge's structure. The judges' default prompts put each part between tags (``<question>``, ``<reference_answer>``,
``<response>``; a group judge's responses each between ``<response label="2">`` and ``</response>``).
:func:`escape_tags` writes the opening bracket of any tag in content whose name starts with one of
:data:`STRUCTURE_TAGS` (any case, any spacing, a closing slash, ``<`` or a look-alike bracket) as its HTML character
reference (``&lt;/response>``): a reader sees the text, never a tag; ``html.unescape`` gives the text back.

One-character special tokens (no chat format has one) cannot be broken by a mark and are left as they are.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import RewardInputError

__all__ = ["COMMON_MARKERS", "STRUCTURE_TAGS", "special_token_strings", "neutralize_markup",
           "hide_markup", "hide_messages", "markup_ids", "map_strings", "escape_tags"]

#: The chat markers :func:`neutralize_markup` breaks when no tokenizer is at hand: ChatML (Qwen, Phi-4), Llama 3,
#: Mistral, Gemma, Phi-3 and DeepSeek (whose bars and spaces are the full-width ``｜`` and ``▁``).
COMMON_MARKERS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|im_sep|>", "<|endoftext|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
    "<|python_tag|>",
    "[INST]", "[/INST]", "<s>", "</s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[THINK]", "[/THINK]",
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
)
#: The tag names of the judges' default prompts; :func:`escape_tags` escapes any tag in content whose name starts
#: with one of them (``reference`` covers ``reference_answer``).
STRUCTURE_TAGS: tuple[str, ...] = ("question", "reference", "response")

#: What :func:`hide_markup` puts after a special-token string's first character (removed again by :func:`markup_ids`).
HIDDEN = "\ufdd0"
#: What :func:`neutralize_markup` puts there (see the module doc for why a space).
_BREAK = " "
#: ``<`` and the brackets a reader may take for it.
_OPENERS = "<\uff1c\ufe64\u2039\u3008\u27e8\u2329"
#: Format characters a reader does not see: a tag may hold them anywhere (``<\u200b/resp\u200bonse>``).
_INVISIBLE = "\u00ad\u200b-\u200f\u2060-\u2064\ufeff"
_NAMES = "|".join(f"[{_INVISIBLE}]*".join(map(re.escape, name)) for name in STRUCTURE_TAGS)
_TAG = re.compile(rf"[{_OPENERS}](?=[\s{_INVISIBLE}]*/?[\s{_INVISIBLE}]*(?:{_NAMES}))", re.IGNORECASE)


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings of ``tokenizer``'s special tokens (``all_special_tokens`` and the added tokens marked special),
    longest first; one-character ones left out (see the module doc)."""
    return _specials(tokenizer).strings


def neutralize_markup(text: str, special_tokens: Iterable[str] | None = None) -> str:
    """``text`` with each occurrence of a marker (``special_tokens``, else :data:`COMMON_MARKERS`) broken by a space
    after its first character, until none is left: no marker occurs in the result, applying it again changes nothing,
    and a text without a marker is returned unchanged."""
    markers = COMMON_MARKERS if special_tokens is None else tuple(special_tokens)
    return _break(text, _pattern(markers), _BREAK)


def hide_markup(text: str, tokenizer: Any) -> str:
    """``text`` (content) with every special-token string of ``tokenizer`` marked, for :func:`markup_ids` to tokenize
    as text; unchanged when it holds none."""
    return _break(text, _specials(tokenizer).pattern, HIDDEN)


def hide_messages(messages: Sequence[Mapping[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """A copy of the chat ``messages`` with :func:`hide_markup` applied to every string they hold but their roles."""
    return map_strings(messages, functools.partial(hide_markup, tokenizer=tokenizer))


def markup_ids(text: str, tokenizer: Any) -> list[int]:
    """The ids of ``text``, rendered by a template from content that went through :func:`hide_markup`: each
    special-token string left whole (the template's own) a control token, the text between them tokenized without
    special-token parsing. ``RewardInputError`` if the tokenizer still gives a special id there (it ignores
    ``split_special_tokens``)."""
    if HIDDEN not in text:
        # No content held a special-token string, so every one in the text is the template's: tokenized exactly as
        # before (and as apply_chat_template(tokenize=True) does), so a benign input keeps its ids to the token. The
        # split path below gives the same ids for byte-level BPE tokenizers, but not for every tokenizer (a
        # sentencepiece one prepends a space to each piece it tokenizes alone).
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    specials = _specials(tokenizer)
    pieces, tokens, start = [], [], 0
    for match in specials.pattern.finditer(text):
        pieces.append(text[start:match.start()])
        tokens.append(match.group())
        start = match.end()
    pieces.append(text[start:])
    for k, token in enumerate(tokens):  # as the tokenizer matches them: an lstrip/rstrip token takes the spaces by it
        if token in specials.lstrip:
            pieces[k] = pieces[k].rstrip()
        if token in specials.rstrip:
            pieces[k + 1] = pieces[k + 1].lstrip()
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        piece = piece.replace(HIDDEN, "")
        if piece:
            piece_ids = list(tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])
            if specials.ids & set(piece_ids):
                raise RewardInputError(
                    f"{type(tokenizer).__name__} ignores split_special_tokens=True: content that spells a special "
                    "token would reach the model as that control token. Fix: use a fast tokenizer (tokenizer.json) "
                    "for this model")
            ids += piece_ids
        if k < len(tokens):
            ids.append(specials.id_of[tokens[k]])
    return ids


def map_strings(messages: Sequence[Mapping[str, Any]], fn: Callable[[str], str]) -> list[dict[str, Any]]:
    """A copy of the chat ``messages`` with ``fn`` applied to every string they hold (content, a multi-part content's
    text, tool calls' arguments...), except each message's ``role`` and the keys."""
    return [{key: value if key == "role" else _map(value, fn) for key, value in message.items()}
            for message in messages]


def escape_tags(text: str) -> str:
    """``text`` with the opening bracket of each tag whose name starts with one of :data:`STRUCTURE_TAGS` (any case
    and spacing: ``</response>``, ``< Response label='2'>``, ``＜question＞``) as its HTML character reference
    (``&lt;``, ``&#xFF1C;``); unchanged when it holds none. ``html.unescape`` gives the text back."""
    return _TAG.sub(lambda m: "&lt;" if m.group() == "<" else f"&#x{ord(m.group()):X};", text)


def _map(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {key: _map(item, fn) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_map(item, fn) for item in value]
    return value


def _break(text: str, pattern: re.Pattern[str] | None, mark: str) -> str:
    """``text`` with ``mark`` after the first character of each match of ``pattern``, until none is left (a pass may
    leave a match that overlapped one it broke; each character starts a match at most once, so this ends)."""
    if pattern is None:
        return text
    while True:
        broken = pattern.sub(lambda m: m.group()[0] + mark + m.group()[1:], text)
        if broken == text:
            return text
        text = broken


@functools.lru_cache(maxsize=64)
def _pattern(markers: tuple[str, ...]) -> re.Pattern[str] | None:
    """One expression for ``markers``, longest first (so ``<|endoftext|>`` wins over a shorter marker it starts
    with); None when there are none."""
    usable = sorted({m for m in markers if len(m) >= 2}, key=lambda m: (-len(m), m))
    return re.compile("|".join(map(re.escape, usable))) if usable else None


@dataclass(frozen=True)
class _Specials:
    """What :func:`markup_ids` needs of a tokenizer: its special-token strings, their pattern and ids, and those that
    take the spaces beside them."""

    size: int
    strings: tuple[str, ...]
    pattern: re.Pattern[str] | None
    id_of: dict[str, int]
    ids: frozenset[int]
    lstrip: frozenset[str]
    rstrip: frozenset[str]


#: Each tokenizer's :class:`_Specials`, computed again when its vocabulary grows.
_CACHE: weakref.WeakKeyDictionary[Any, _Specials] = weakref.WeakKeyDictionary()


def _specials(tokenizer: Any) -> _Specials:
    cached = _CACHE.get(tokenizer)
    if cached is not None and cached.size == len(tokenizer):
        return cached
    added = {token.content: token for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
             if getattr(token, "special", False)}
    found = set(tokenizer.all_special_tokens) | set(added)
    strings = tuple(sorted((s for s in found if len(s) >= 2), key=lambda s: (-len(s), s)))
    id_of = {s: int(tokenizer.convert_tokens_to_ids(s)) for s in strings}
    specials = _Specials(
        size=len(tokenizer), strings=strings, pattern=_pattern(strings), id_of=id_of,
        # the unknown token is what text the vocabulary lacks becomes: no sign that a piece was parsed
        ids=(frozenset(id_of.values()) | frozenset(int(i) for i in tokenizer.all_special_ids))
        - {getattr(tokenizer, "unk_token_id", None)},
        lstrip=frozenset(s for s, t in added.items() if getattr(t, "lstrip", False)),
        rstrip=frozenset(s for s, t in added.items() if getattr(t, "rstrip", False)))
    try:
        _CACHE[tokenizer] = specials
    except TypeError:  # a tokenizer that cannot be weakly referenced is read each time
        pass
    return specials
