"""Judge RMs' models (``reward_kind='judge'``): the ``logits`` readout on transformers and the ``generate`` engine
on vLLM. The prompt and the verdict's text are :mod:`.judge_text`'s.

- ``judge_readout='logits'``: one forward on transformers (the replica's :class:`~.forward.RMForward`, padded or
  packed). The final norm's output is read at each row's last token (the model computes its LM head at one position
  only, ``logits_to_keep=1``) and :class:`JudgeLogits` applies the LM head's rows of ``judge_tokens`` to it. The
  scorer checks it at load against the model's own next-token logits.
- ``judge_readout='generate'``: :class:`VLLMJudge`, a vLLM engine in the replica's process (greedy, at most
  ``judge_max_tokens``); the scorer parses each text (:func:`~.judge_text.parse_verdict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from verl_async_rm.errors import ConfigValueError
from verl_async_rm.scoring.judge_text import Generated
from verl_async_rm.scoring.vllm_forward import VLLMForward

__all__ = ["JudgeLogits", "VLLMJudge", "judge_token_ids", "final_norm"]


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
                "tokenizer writes one, e.g. ' Yes'); tokenizer.tokenize(text) shows how it splits",
            )
        ids.append(int(encoded[0]))
    if len(set(ids)) != len(ids):
        raise ConfigValueError("judge_tokens", list(strings), f"they map to repeated token ids {ids}",
                               "list distinct tokens")
    return ids


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output the LM head reads (the decoder's final norm); ``ConfigValueError`` if not found."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        module = getattr(decoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ConfigValueError(
        "judge_readout", "logits", f"{type(model).__name__} has no final norm the plugin knows (norm, ln_f, ...) to "
        "read the hidden state its LM head reads", "use judge_readout='generate'",
    )


class JudgeLogits(torch.nn.Module):
    """The LM head's rows of ``judge_tokens`` applied to final hidden states ``(N, H) -> (N, 1)``: the first token's
    probability renormalised over the listed tokens (two or more), or the token's raw logit (one). Gemma-style
    ``final_logit_softcapping`` is applied as the model does; other output scalings are caught by the load check."""

    def __init__(self, model: torch.nn.Module, token_ids: Sequence[int]) -> None:
        super().__init__()
        head = model.get_output_embeddings()
        index = torch.tensor(list(token_ids), device=head.weight.device)
        self.weight = head.weight.detach().index_select(0, index).clone()
        bias = getattr(head, "bias", None)
        self.bias = bias.detach().index_select(0, index).clone() if bias is not None else None
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The listed tokens' next-token logits, ``(N, K)`` float32."""
        logits = torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.logits(hidden)
        if logits.shape[-1] == 1:
            return logits
        return torch.softmax(logits, dim=-1)[..., :1]


class VLLMJudge(VLLMForward):
    """A vLLM generation engine for a judge, in the replica's process: each row's text, greedy (temperature 0), at
    most ``judge_max_tokens`` tokens. Rows vLLM fails on fail alone (the call is halved), a dead engine ends the
    replica, and a group's shared judge prompt reuses the prefix cache (:class:`VLLMForward`'s behaviour)."""

    runner = "generate"

    def __init__(self, config: Any, *, max_length: int | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, max_length=max_length, dtype=dtype, device=device)
        from vllm import SamplingParams

        self._sampling = SamplingParams(temperature=0.0, max_tokens=config.judge_max_tokens, seed=0)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "judge_readout": "generate", "judge_max_tokens": self.config.judge_max_tokens}

    def _run(self, rows: Sequence[Sequence[int]]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        outputs = self._engine_call(lambda llm: llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids)) for ids in rows], self._sampling, use_tqdm=False
        ))
        return [Generated(out.outputs[0].text, len(out.outputs[0].token_ids)) for out in outputs]
