"""References for the judge-RM tests, written independently of the plugin's judge code: the judge prompt rendered
with plain Jinja and the judge's chat template, then one plain transformers forward (``logits``) or transformers'
greedy ``generate`` (``generate``)."""

from __future__ import annotations

import re

import jinja2

LOGITS_PROMPT = "Question: {{ prompt }}\nResponse: {{ response }}\nReference: {{ ground_truth }}\nCorrect?"
DIGIT_PROMPT = "Q: {{ prompt }} A: {{ response }}"
#: Single tokens of the tiny ChatML vocabulary (" yes" is two tokens there, " correct" and " no" are one each).
TOKENS = [" correct", " no"]


def response_text(policy_tok, response_ids) -> str:
    ids = [int(t) for t in response_ids]
    while ids and ids[-1] in (policy_tok.eos_token_id, policy_tok.pad_token_id):
        ids.pop()
    return policy_tok.decode(ids, skip_special_tokens=True)


def judge_ids(judge_tok, template: str, question: str, response: str, ground_truth: str = "") -> list[int]:
    text = jinja2.Template(template, keep_trailing_newline=True).render(
        prompt=question, response=response, ground_truth=ground_truth, messages=[])
    rendered = judge_tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return judge_tok(rendered, add_special_tokens=False)["input_ids"]


def logits_reference(model, judge_tok, ids, tokens=TOKENS) -> float:
    """The first token's probability renormalised over ``tokens`` (or one token's raw logit), from one plain forward."""
    import torch

    token_ids = [judge_tok(t, add_special_tokens=False)["input_ids"][0] for t in tokens]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1, token_ids].float()
    return float(logits[0]) if len(tokens) == 1 else float(torch.softmax(logits, -1)[0])


def generate_reference(model, judge_tok, ids, max_new_tokens: int, pattern: str) -> tuple[str, float | None]:
    """The judge's greedy text (transformers' ``generate``) and its verdict (None when the pattern finds none)."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=judge_tok.eos_token_id, pad_token_id=judge_tok.pad_token_id)
    text = judge_tok.decode(out[0, len(ids):], skip_special_tokens=True)
    matches = re.findall(pattern, text)
    return text, float(matches[-1]) if matches else None
