"""The reward model in one process: load it, turn trajectories into input, run forwards, read one score each.

:class:`RewardModelScorer` is what each RM worker (:mod:`verl_async_rm.service.replica`) holds; it has no Ray in it, so
it can be tested and benchmarked in-process.

Scores are read at the last valid token of the attention mask, not by ``pad_token_id``: HF decoder
sequence-classification models pick "the rightmost token that is not pad_token_id", which is wrong when a real token
equals the pad id (pad id 0 being a real token, or pad = EOS and the response ends with EOS). The scorer hooks the
head module (``score``, ``v_head`` or ``classifier``) to get its per-token output and indexes it itself. Heads that
see an already pooled input (encoder classifiers) and ``score_head='none'`` use the model's own ``logits``.

The forward passes themselves (padded or packed micro-batches, score extraction, failure isolation) are
:class:`verl_async_rm.scoring.forward.RMForward`'s; the scorer loads the model, builds each request's input ids and
counts.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from verl_async_rm.errors import JudgeVerdictError, NonFiniteScoreError, RewardInputError, RewardModelError
from verl_async_rm.scoring.checkpoint import check_rm_checkpoint, load_reward_model, load_tokenizer
from verl_async_rm.errors import ConfigValueError
from verl_async_rm.scoring.rm_config import RMConfig, vllm_unsupported
from verl_async_rm.scoring.forward import RMForward, last_token_logits, reduce_outputs
from verl_async_rm.scoring.inputs import prepare_input_ids, tokenizers_match
from verl_async_rm.scoring.sharding import (
    FailureAgreement,
    ShardGroup,
    check_same_forward,
    join_group,
    load_sharded,
)
from verl_async_rm.scoring.judge_text import Generated, Verdict
from verl_async_rm.scoring.offload import Move, WeightOffload
from verl_async_rm.scoring.packing import pack_rows
from verl_async_rm.scoring.process import ProcessInput, StepRewards, prepare_process_input, reduce_steps
from verl_async_rm.request import RMRequest

logger = logging.getLogger(__name__)

__all__ = ["RewardModelScorer", "ScorerStats", "resolve_dtype", "last_token_logits", "reduce_outputs"]

_AUTO_HEADS = ("score", "v_head", "classifier")
#: Texts of the load-time check of ``engine='vllm'`` (as the RM's tokenizer reads them).
_CHECK_TEXTS = (
    "The answer is 42.",
    "Let me think step by step. Three apples plus four apples make seven apples, so the answer is 7.",
    "no",
)


@dataclasses.dataclass
class ScorerStats:
    """A scorer's counters (:meth:`RewardModelScorer.stats`, per step :meth:`RewardModelScorer.pop_step_stats`)."""

    requests: int = 0
    failed: int = 0  #: requests that got an error (bad input, NaN/inf score, a forward that failed for them)
    truncated: int = 0  #: inputs cut to max_length
    tokens: int = 0  #: RM input tokens built
    busy_s: float = 0.0  #: seconds inside score()
    steps_dropped: int | None = None  #: process RMs only: leading steps left unscored (input beyond max_length)
    judge_tokens: int | None = None  #: judges that write their verdict only: tokens the judge wrote
    judge_parse_failures: int | None = None  #: judges that write their verdict only: verdicts that did not parse

    @classmethod
    def zero(cls, process: bool, generate: bool = False) -> ScorerStats:
        return cls(steps_dropped=0 if process else None, judge_tokens=0 if generate else None,
                   judge_parse_failures=0 if generate else None)


def resolve_dtype(name: str, on_gpu: bool) -> torch.dtype:
    """``RMConfig.dtype`` as a torch dtype ('auto': bfloat16 on GPU, float32 on CPU)."""
    if name == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


class RewardModelScorer:
    """A HF RM, ready to score :class:`RMRequest` batches: a sequence-classification (outcome), token-classification
    (process) or causal-LM judge RM (``reward_kind='judge'``: read at its next token through the forwards, or by the
    verdict a vLLM engine writes; :mod:`~verl_async_rm.scoring.judge`).

    Args:
        config: the RM settings.
        device: where to run; default: the current CUDA device when ``config.use_gpu``, else CPU (no verl import).
        shard: this process's rank in a sharded replica (:mod:`~verl_async_rm.scoring.sharding`); ``store``: the
            ``TCPStore`` rank 0 hosts (rank 0 only).
    """

    def __init__(self, config: RMConfig, device: str | torch.device | None = None, shard: ShardGroup | None = None,
                 store: Any = None) -> None:
        self.config = config
        if device is None:
            device = _default_device(config.use_gpu)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(config.dtype, self.device.type != "cpu")
        _check_dir(config.model_path, "model_path")
        if config.retemplate != "never":
            _check_dir(config.policy_tokenizer_path, "policy_tokenizer_path")

        check_rm_checkpoint(config.model_path, config.trust_remote_code, config.reward_kind)
        self.rm_tokenizer = load_tokenizer(config.model_path, "model_path", config.trust_remote_code)
        self.process = config.reward_kind == "process"
        self.judge = config.reward_kind == "judge"
        #: A judge that writes its verdict: no transformers model, a vLLM generation engine (set up below).
        self.generate = self.judge and config.judge_readout == "generate"
        if self.generate:
            self._init_generate_judge()
        else:
            self._init_model(shard, store)
        self._init_policy_side()
        self._stats = ScorerStats.zero(self.process, self.generate)
        self._step = ScorerStats.zero(self.process, self.generate)
        self._warned_truncation = False
        self._offloader: WeightOffload | None = None  # made at the first sleep (placement='policy_pool')
        #: What runs the forwards ('hf' or 'vllm') and why (config.engine, vLLM's support, the load-time check).
        self.engine, self.engine_reason = "hf", "engine='hf'"
        if self.generate:
            self._start_judge_engine()
        elif self.judge:
            self._check_judge_logits()
            self.engine_reason = "a judge's logits readout runs on transformers"
        elif config.engine != "hf":
            self._start_vllm()
        logger.info(
            "RM %s (%s, %s) loaded on %s (%s, %s attention, %d output(s), head=%s, max_length=%s, retemplate=%s, "
            "forwards %s%s, engine %s)",
            config.model_path,
            type(self.model).__name__ if self.model is not None else "vLLM",
            config.reward_kind,
            self.device,
            self.dtype,
            config.attn_implementation,
            self.num_labels,
            self.head_name,
            self.max_length,
            self.retemplate,
            self.forward.describe()["packing"],
            f", reward token {self.suffix_ids} appended" if self.suffix_ids else "",
            self.engine,
        )

    def _init_model(self, shard: ShardGroup | None, store: Any) -> None:
        """Load the transformers model (sharded over ``shard``'s ranks if given) and its forwards."""
        config = self.config
        load = functools.partial(
            load_reward_model, config.model_path, trust_remote_code=config.trust_remote_code,
            attn_implementation=config.attn_implementation, reward_kind=config.reward_kind, dtype=self.dtype,
        )
        #: How the weights are split over a sharded replica's ranks (``sharding``: none, tensor_parallel, fsdp2).
        self.sharding = {"sharding": "none"}
        agreement = None
        if shard is None:
            model = load().to(self.device)
        else:  # every rank of the replica runs this same code, in step (collectives inside load and forwards)
            store = join_group(shard, self.device, store)
            agreement = FailureAgreement(store, shard.rank, shard.world_size)
            model, self.sharding = load_sharded(load, config.model_path, config.trust_remote_code, self.device,
                                                shard.world_size)
        model.config.use_cache = False
        self.model = model.eval().requires_grad_(False)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

        self.num_labels = int(model.config.num_labels)
        if config.score_output_field is None:  # else checked on the output field itself (readout.check_output_field)
            self._check_score_index()
        max_positions = getattr(text_config, "max_position_embeddings", None)
        self.max_length = config.max_length or max_positions
        if config.max_length and max_positions and config.max_length > max_positions:
            logger.warning(
                "max_length=%d is more than the RM's max_position_embeddings=%d: longer inputs go beyond the "
                "positions the RM was trained on", config.max_length, max_positions,
            )
        #: Token ids the RM can embed (its input embedding rows).
        self.rm_vocab_size = int(model.get_input_embeddings().num_embeddings)
        # Padding positions are masked out, so the pad id only has to be a valid token id.
        self.pad_id = next(
            (i for i in (self.rm_tokenizer.pad_token_id, self.rm_tokenizer.eos_token_id) if i is not None), 0
        )
        transform, forward_kwargs = None, None
        if self.judge:  # the final norm's output, read at the last token through the judge tokens' LM-head rows
            from verl_async_rm.scoring.judge import JudgeLogits, final_norm, judge_token_ids

            self.head_name, self.head = "final norm -> judge_tokens", final_norm(model)
            self.judge_token_ids = judge_token_ids(self.rm_tokenizer, config.judge_tokens, self.rm_vocab_size,
                                                   config.model_path)
            transform, forward_kwargs = JudgeLogits(model, self.judge_token_ids), _keep_last_logits(model)
        elif config.score_output_field is not None:
            self.head_name, self.head = f"output.{config.score_output_field}", None
        else:
            self.head_name, self.head = self._find_head(config.score_head)
        #: Ids appended to every outcome input: the reward token of InternLM2-style RMs (``config.reward_token_id``),
        #: whose score is read there.
        outcome = config.reward_kind == "outcome"
        self.suffix_ids = _reward_token(model.config) if outcome and self.head is not None else []
        #: Process RMs: the step separator's id (checked to be one token of the RM's vocabulary).
        self.separator_id = self._separator_id() if self.process else None
        if self.head is not None and getattr(text_config, "pad_token_id", None) is None:
            # HF refuses batches > 1 without a pad id; the scorer reads scores by the mask, so any id will do.
            text_config.pad_token_id = self.pad_id
        #: The forward passes (padded or packed, see ``config.packing``), score extraction, failure isolation.
        self.forward = RMForward(
            self.model,
            self.head,
            device=self.device,
            pad_id=self.pad_id,
            packing=config.packing,
            score_reduction=config.score_reduction,
            score_index=config.score_index,
            share_prompts=config.share_prompts,
            output_field=config.score_output_field,
            label_index=config.process_label_index if self.process else None,
            on_failure=agreement,
            transform=transform,
            forward_kwargs=forward_kwargs,
        )
        if shard is not None:
            check_same_forward(self.forward.describe())

    def _init_policy_side(self) -> None:
        """The policy's tokenizer (to decode responses) and whether inputs are re-rendered for the RM."""
        config = self.config

        self.policy_tokenizer = None
        self.response_stop_ids: set[int] = set()
        if config.retemplate != "never":
            self.policy_tokenizer = load_tokenizer(
                config.policy_tokenizer_path, "policy_tokenizer_path", config.trust_remote_code
            )
            self.response_stop_ids = _stop_ids(self.policy_tokenizer, config.policy_tokenizer_path)
        #: Response ids the policy may produce: its tokenizer's ids, and the padded embedding rows past them (no text).
        self.policy_id_limit = _policy_id_limit(self.policy_tokenizer, config.policy_tokenizer_path)
        if self.judge:  # a judge always reads its own prompt, rendered with its chat template
            from verl_async_rm.scoring.judge_text import compile_pattern, compile_prompt

            self.judge_template = compile_prompt(config.judge_prompt)
            self.judge_pattern = compile_pattern(config.judge_pattern) if self.generate else None
            self.judge_labels = dict(config.judge_labels or ())
            self.retemplate = True
            if not getattr(self.rm_tokenizer, "chat_template", None):
                raise ConfigValueError(
                    "model_path", config.model_path, "the judge's tokenizer has no chat template to render "
                    "judge_prompt with", "give it one (chat_template in tokenizer_config.json, or a chat_template.jinja "
                    "next to it), e.g. an instruct model's",
                )
            return
        if config.retemplate == "always":
            self.retemplate = True
        elif config.retemplate == "never":
            self.retemplate = False
            self._check_ids_can_be_reused()
        else:
            self.retemplate = not tokenizers_match(self.policy_tokenizer, self.rm_tokenizer)
        if (self.retemplate or self.process) and not getattr(self.rm_tokenizer, "chat_template", None):
            raise ConfigValueError(
                "model_path",
                config.model_path,
                "the RM tokenizer has no chat template, so the conversation cannot be re-rendered for it (its "
                "tokenizer or template differs from the policy's)",
                "give it one (chat_template in tokenizer_config.json, or a chat_template.jinja next to it); or, if "
                "the RM was trained on the policy's exact tokenizer and chat format, set retemplate='never' (verl: "
                "+async_rm.retemplate=never) to feed it the policy's token ids",
            )

    # ----------------------------------------------------------------------------------------------------- scoring

    def prepare(self, request: RMRequest) -> tuple[list[int], bool]:
        """The RM input ids for ``request`` and whether they were truncated (raises :class:`RewardInputError`)."""
        if self.judge:
            from verl_async_rm.scoring.judge_text import judge_input_ids

            room = self.max_length
            if self.generate and room is not None:
                room -= self.config.judge_max_tokens  # the verdict must fit in the engine's context too
            ids = judge_input_ids(
                request, template=self.judge_template, tokenizer=self.rm_tokenizer,
                policy_tokenizer=self.policy_tokenizer, response_stop_ids=self.response_stop_ids, max_length=room,
                id_limit=self.policy_id_limit,
            )
            return ids, False
        return prepare_input_ids(
            request,
            rm_tokenizer=self.rm_tokenizer,
            policy_tokenizer=self.policy_tokenizer,
            retemplate=self.retemplate,
            response_stop_ids=self.response_stop_ids,
            max_length=self.max_length,
            id_limit=self.policy_id_limit if self.retemplate else self.rm_vocab_size,
            suffix_ids=self.suffix_ids,
        )

    def prepare_process(self, request: RMRequest) -> ProcessInput:
        """A process RM's input for ``request``: ids, the separator positions to read, the policy token where each
        step ends (raises :class:`RewardInputError`)."""
        assert self.separator_id is not None and self.config.step_separator is not None, "a process RM"
        return prepare_process_input(
            request,
            rm_tokenizer=self.rm_tokenizer,
            policy_tokenizer=self.policy_tokenizer,
            delimiter=self.config.step_delimiter,
            separator=self.config.step_separator,
            separator_id=self.separator_id,
            response_stop_ids=self.response_stop_ids,
            max_length=self.max_length,
            id_limit=self.policy_id_limit,
        )

    def score(self, requests: Sequence[RMRequest]) -> list[float | StepRewards | Verdict | RewardModelError]:
        """One entry per request: its score, or the error that kept that request from being scored. A process RM
        with ``process_reduction='none'`` gives :class:`StepRewards` (a score per step and where it goes).

        A bad request (unusable input, NaN/inf score, a forward that failed for its micro-batch) fails only its own
        entry; the call itself does not raise.
        """
        start = time.perf_counter()
        results: list[Any] = [None] * len(requests)
        inputs: list[list[int]] = []
        owners: list[int] = []
        steps: list[ProcessInput] = []
        truncated = 0
        for i, request in enumerate(requests):
            try:
                if self.process:
                    prepared = self.prepare_process(request)
                    ids, cut = prepared.ids, prepared.truncated
                    steps.append(prepared)
                else:
                    ids, cut = self.prepare(request)
            except RewardInputError as err:
                results[i] = err
                continue
            except Exception as err:  # a tokenizer or template failure belongs to this item only
                results[i] = RewardInputError(f"trajectory {_uid(request)}: cannot build RM input: {err!r}")
                results[i].__cause__ = err  # the one wrap of this failure: its cause travels with it
                continue
            truncated += cut
            inputs.append(ids)
            owners.append(i)

        lengths = [len(ids) for ids in inputs]
        groups = [requests[i].group for i in owners]  # GRPO siblings: their common prompt can run once
        reads = [p.positions for p in steps] if self.process else None
        scores = self.forward.score_all(inputs, self.config.micro_batch_max_tokens, groups, reads)
        for k, (i, value) in enumerate(zip(owners, scores, strict=True)):
            results[i] = value if isinstance(value, RewardModelError) else self._result(
                requests[i], value, steps[k] if self.process else None
            )

        failed = sum(isinstance(r, Exception) for r in results)
        dropped = sum(p.dropped for p in steps)
        if dropped:
            logger.warning(
                "process RM: %d leading step(s) of %d trajectories left unscored: their input exceeded "
                "max_length=%s even without the prompt", dropped, sum(p.dropped > 0 for p in steps), self.max_length,
            )
        self._count(len(requests), failed, truncated, sum(lengths), time.perf_counter() - start, dropped)
        if truncated:
            logger.debug("%d of %d RM inputs truncated to max_length=%s", truncated, len(requests), self.max_length)
        assert all(r is not None for r in results), "every request gets a score or an error"
        return results  # type: ignore[return-value]

    def _result(self, request: RMRequest, value: Any, steps: ProcessInput | None) -> Any:
        """A forward's value as the request's result: a finite score, :class:`StepRewards`, a judge's
        :class:`Verdict`, or the error."""
        if isinstance(value, Generated):
            return self._verdict(request, value)
        values = value if steps is not None else [value]
        if not all(math.isfinite(v) for v in values):
            return NonFiniteScoreError(f"trajectory {request.uid}: the RM returned {value}")
        if steps is None:
            return value
        if self.config.process_reduction == "none":
            return StepRewards(tuple(values), tuple(steps.token_index), steps.dropped)
        return reduce_steps(values, self.config.process_reduction)

    def _verdict(self, request: RMRequest, generated: Generated) -> Verdict | JudgeVerdictError:
        """A ``generate`` judge's text parsed into its :class:`Verdict`, or the error that fails this trajectory."""
        from verl_async_rm.scoring.judge_text import VERDICT_CHARS, parse_verdict

        for counters in (self._stats, self._step):
            counters.judge_tokens += generated.tokens  # type: ignore[operator]
        try:
            score = parse_verdict(generated.text, self.judge_pattern, self.judge_labels)
        except JudgeVerdictError as err:
            for counters in (self._stats, self._step):
                counters.judge_parse_failures += 1  # type: ignore[operator]
            failure = JudgeVerdictError(f"judge {self.config.model_path}: trajectory {request.uid}: {err}")
            failure.__cause__ = err
            return failure
        return Verdict(score, generated.text[-VERDICT_CHARS:])

    def forward_ids(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores (float32, one per row) of already prepared input ids, in one forward pass (packed or padded)."""
        return self.forward.forward_ids(batch)

    def describe(self) -> dict[str, Any]:
        """What this scorer serves: device, dtype, retemplating, max_length, outputs, and how forwards run."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype),
            "retemplate": self.retemplate,
            "max_length": self.max_length,
            "num_labels": self.num_labels,
            "engine": self.engine,
            "engine_reason": self.engine_reason,
            **({"judge_readout": self.config.judge_readout} if self.judge else {}),
            **self.sharding,
            **self.forward.describe(),
        }

    # ------------------------------------------------------------------------------------------------------ engine

    def _start_vllm(self) -> None:
        """``engine='vllm'`` or ``'auto'``: move the forwards to a vLLM engine when it serves this RM and scores the
        load-time check inputs as the transformers forward does (one row at a time, the RM's dtype, within
        :func:`~verl_async_rm.scoring.vllm_forward.check_tolerance`); else, under ``'auto'``, stay on transformers
        (the reason logged and in :meth:`describe`), and under ``'vllm'`` refuse to load (``RewardModelError``)."""
        from verl_async_rm.scoring.vllm_forward import VLLMForward, check_tolerance, vllm_version

        reason = vllm_unsupported(self.config)
        if reason is None and self.head_name != "score":
            reason = f"vLLM reads a 'score' head; this RM's scores come from {self.head_name!r}"
        if reason is None and vllm_version() is None:
            reason = "vLLM is not installed (or fails to import) in the replica's environment"
        if reason is None:
            rows = self._check_rows()
            reference = [float(self.forward.forward_ids([ids])[0]) for ids in rows]
            self._park_model("cpu")  # the engine gets the device's memory; transformers stays for a fallback
            engine = None
            try:
                engine = VLLMForward(self.config, max_length=self.max_length, dtype=self.dtype, device=self.device)
                got = engine.forward_ids(rows).tolist()
            except Exception as err:  # noqa: BLE001 - an architecture, kernel or setting vLLM refuses: say which
                reason = f"vLLM could not {'load' if engine is None else 'run'} the RM: {err!r}"
                if engine is not None:
                    engine.close()
            else:
                diff = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, reference, strict=True))
                tolerance = check_tolerance(self.dtype)
                if diff <= tolerance:  # False for NaN too
                    engine.canary = rows[0]
                    self._use_engine(engine, f"vLLM {vllm_version()} scores the {len(rows)} load-time check "
                                             f"inputs as transformers within {diff:.2g} (tolerance {tolerance:g})")
                    return
                engine.close()
                reason = (f"vLLM scores the load-time check inputs differently from transformers: {got} against "
                          f"{reference}, a relative difference of {diff:.3g} > {tolerance:g}")
            self._park_model(self.device)
        if self.config.engine == "vllm":
            raise RewardModelError(
                f"engine='vllm' for the RM at {self.config.model_path}: {reason}. Fix: use engine='hf' or "
                "engine='auto' (vLLM where it can serve the RM, else transformers)"
            )
        self.engine_reason = f"engine='auto' chose transformers: {reason}"
        logger.warning("RM %s: %s", self.config.model_path, self.engine_reason)

    def _init_generate_judge(self) -> None:
        """A judge that writes its verdict: what the scorer needs from the checkpoint's config, no transformers model
        (its vLLM engine starts once the policy side is ready: :meth:`_start_judge_engine`)."""
        from transformers import AutoConfig

        config = self.config
        model_config = AutoConfig.from_pretrained(config.model_path, trust_remote_code=config.trust_remote_code)
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.model, self.forward, self.sharding = None, None, {"sharding": "none"}
        self.num_labels, self.head_name, self.head = 1, "vLLM generate -> judge_pattern", None
        self.suffix_ids, self.separator_id = [], None
        self.rm_vocab_size = int(text_config.vocab_size)
        self.pad_id = self.rm_tokenizer.pad_token_id or 0
        self.max_length = config.max_length or getattr(text_config, "max_position_embeddings", None)
        if self.max_length is not None and self.max_length <= config.judge_max_tokens:
            raise ConfigValueError(
                "judge_max_tokens", config.judge_max_tokens, f"the judge's context is max_length={self.max_length} "
                "tokens, which must hold its input and its verdict", "set judge_max_tokens below max_length (or "
                "raise max_length)",
            )

    def _start_judge_engine(self) -> None:
        """Start the ``generate`` judge's vLLM engine and write one verdict at load: the engine runs, and that input
        is its known-good probe (a row failing alone while the probe fails too means a dead engine)."""
        from verl_async_rm.scoring.judge import VLLMJudge

        self.forward = VLLMJudge(self.config, max_length=self.max_length, dtype=self.dtype, device=self.device)
        probe = RMRequest(uid="load-check", prompt_ids=[], response_ids=self.policy_tokenizer(_CHECK_TEXTS[1])[
            "input_ids"], raw_prompt=[{"role": "user", "content": "How many apples are three plus four apples?"}],
                          ground_truth="7")
        ids, _ = self.prepare(probe)
        first = self.forward.score_all([ids], self.config.micro_batch_max_tokens)[0]
        if isinstance(first, Exception):
            self.forward.close()
            raise RewardModelError(f"the judge's vLLM engine failed on the load-time input: {first!r}") from first
        self.forward.canary = ids
        self.engine = "vllm"
        self.engine_reason = f"judge_readout='generate' (vLLM {self.forward.describe()['vllm']})"
        logger.info("judge %s wrote at load (%d tokens): %r", self.config.model_path, first.tokens, first.text[-200:])

    def _check_judge_logits(self) -> None:
        """The ``logits`` readout (final norm, judge tokens' LM-head rows) must give what the model's own next-token
        logits give, on the load-time texts; else ``ConfigValueError`` (an output scaling the plugin does not know)."""
        from verl_async_rm.scoring.judge import JudgeLogits
        from verl_async_rm.scoring.vllm_forward import check_tolerance

        readout = self.forward.transform
        assert isinstance(readout, JudgeLogits)
        rows = self._check_rows()
        got = torch.cat([self.forward.forward_ids([ids]) for ids in rows])
        with torch.no_grad():
            reference = []
            for ids in rows:
                kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids], device=self.device)}
                if self.forward.kernel == "varlen":  # the model's attention is the packed kernel now
                    packed = pack_rows([ids], self.device)
                    kwargs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                              **packed.varlen_kwargs()}
                logits = self.model(**kwargs, use_cache=False).logits[0, -1].float()
                chosen = logits[self.judge_token_ids].unsqueeze(0)
                value = chosen if chosen.shape[-1] == 1 else torch.softmax(chosen, dim=-1)[:, :1]
                reference.append(float(value[0, 0]))
        reference_t = torch.tensor(reference)
        tolerance = check_tolerance(self.dtype) * (1 + reference_t.abs())
        if not bool(((got - reference_t).abs() <= tolerance).all()):
            raise ConfigValueError(
                "judge_readout", "logits", f"reading {type(self.model).__name__} at its final norm gives {got.tolist()}"
                f" where its own next-token logits give {reference} (an output scaling the plugin does not apply)",
                "use judge_readout='generate'",
            )

    def _use_engine(self, engine: Any, why: str) -> None:
        """Score on ``engine`` from now on and free the transformers model."""
        self.forward.close()
        self.forward, self.model = engine, None
        self.engine, self.engine_reason = "vllm", why
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("RM %s: engine vllm (%s; started in %.1f s)", self.config.model_path, why, engine.start_s)

    def _park_model(self, device: str | torch.device) -> None:
        """Move the transformers model (off the accelerator while vLLM starts, back for a fallback)."""
        if self.device.type != "cpu":
            self.model.to(device)
            if torch.device(device).type == "cpu":
                torch.cuda.empty_cache()

    def _check_rows(self) -> list[list[int]]:
        """The load-time check's inputs: fixed texts in the RM's tokenizer, with the reward token if it has one."""
        limit = (self.max_length or 64) - len(self.suffix_ids)
        rows = []
        for text in _CHECK_TEXTS:
            ids = [i for i in self.rm_tokenizer(text)["input_ids"] if i < self.rm_vocab_size][:limit]
            rows.append([*(ids or [self.pad_id]), *self.suffix_ids])
        return rows

    # ------------------------------------------------------------------------------------------------------- stats

    def sleep(self) -> Move:
        """Release the device's memory: the RM's weights to host memory (``placement='policy_pool'``, while the
        policy trains); :meth:`score` must not run until :meth:`wake`."""
        return self._offload().sleep()

    def wake(self) -> Move:
        """Take the weights back onto the device (a no-op when awake)."""
        return self._offload().wake()

    @property
    def asleep(self) -> bool:
        return self._offloader is not None and self._offloader.asleep

    def _offload(self) -> WeightOffload:
        if self.model is None:
            raise RewardModelError(f"the RM at {self.config.model_path} runs on a vLLM engine ({self.engine_reason}),"
                                   " which the plugin does not put to sleep")
        if self._offloader is None:
            self._offloader = WeightOffload(self.model, self.device)
        return self._offloader

    def stats(self) -> ScorerStats:
        """Counters since load (a copy)."""
        return dataclasses.replace(self._stats)

    def pop_step_stats(self) -> ScorerStats:
        """Counters since the last call (one training step); truncations are logged here, once; then reset."""
        step, self._step = self._step, ScorerStats.zero(self.process, self.generate)
        if step.truncated:
            logger.warning(
                "RM step: %d of %d inputs truncated to max_length=%s (prompt start cut, response end kept); "
                "%d failed", step.truncated, step.requests, self.max_length, step.failed,
            )
        else:
            logger.debug("RM step: %d requests, %d failed", step.requests, step.failed)
        return step

    # ----------------------------------------------------------------------------------------------------- helpers

    def _find_head(self, name: str) -> tuple[str, torch.nn.Module | None]:
        """(name, module) of the head whose per-token output is read; (``"model logits"``, None) for none."""
        if name == "none":
            return "model logits", None
        if name != "auto":
            head = getattr(self.model, name, None)
            if not isinstance(head, torch.nn.Module):
                raise ValueError(
                    f"score_head={name!r}: the model {type(self.model).__name__} has no such module. Fix: use 'auto', "
                    "'none', or the name of the head module (see print(model))"
                )
            return name, head
        for candidate in _AUTO_HEADS:
            head = getattr(self.model, candidate, None)
            if isinstance(head, torch.nn.Module):
                return candidate, head
        logger.warning(
            "no score head among %s on %s; using the model's own pooled logits", _AUTO_HEADS, type(self.model).__name__
        )
        return "model logits", None

    def _check_ids_can_be_reused(self) -> None:
        """retemplate='never': refuse a policy tokenizer whose vocabulary differs from the RM's (when one is given)."""
        path = self.config.policy_tokenizer_path
        if not path or not os.path.isdir(path):  # not needed in this mode: nothing to compare with
            return
        policy = load_tokenizer(path, "policy_tokenizer_path", self.config.trust_remote_code)
        if policy.get_vocab() != self.rm_tokenizer.get_vocab():
            raise ConfigValueError(
                "retemplate",
                "never",
                f"the RM's vocabulary ({self.config.model_path}) differs from the policy's ({path}), so the policy's "
                "token ids would mean other text to the RM",
                "use retemplate='auto' (the default): the conversation is re-rendered as text for the RM",
            )
        if not tokenizers_match(policy, self.rm_tokenizer):
            logger.warning(
                "retemplate='never' with the same vocabulary but another chat template or BOS/EOS than the "
                "policy's: the RM reads the policy's ids in a format it was not trained on"
            )

    def _separator_id(self) -> int:
        """The step separator's token id; ``ValueError`` unless it is exactly one token of the RM's vocabulary."""
        separator = self.config.step_separator
        ids = self.rm_tokenizer(separator, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] >= self.rm_vocab_size:
            raise ConfigValueError(
                "step_separator", separator,
                f"the RM's tokenizer ({self.config.model_path}) reads it as {len(ids)} token(s) {ids}, so the PRM has "
                "no single position to score each step at",
                "set it to the PRM's own step token (one special token of its vocabulary, e.g. '<extra_0>' for "
                "Qwen2.5-Math-PRM)",
            )
        if not 0 <= self.config.process_label_index < self.num_labels:
            raise ConfigValueError(
                "process_label_index", self.config.process_label_index,
                f"the process RM has {self.num_labels} label(s)",
                f"use an index in [0, {self.num_labels - 1}] (1 is 'correct' for two-label PRMs)",
            )
        return int(ids[0])

    def _check_score_index(self) -> None:
        cfg = self.config
        if cfg.score_reduction == "index" and not -self.num_labels <= cfg.score_index < self.num_labels:
            raise ValueError(
                f"score_index={cfg.score_index!r}: the RM at {cfg.model_path} has {self.num_labels} output(s). "
                f"Fix: use an index in [{-self.num_labels}, {self.num_labels - 1}] or a score_reduction"
            )

    def _count(
        self, requests: int, failed: int, truncated: int, tokens: int, seconds: float, steps_dropped: int = 0
    ) -> None:
        for counters in (self._stats, self._step):
            counters.requests += requests
            counters.failed += failed
            counters.truncated += truncated
            counters.tokens += tokens
            counters.busy_s += seconds
            if counters.steps_dropped is not None:
                counters.steps_dropped += steps_dropped
        if truncated and not self._warned_truncation:
            self._warned_truncation = True
            logger.warning(
                "RM inputs longer than max_length=%s are being truncated (prompt start cut, response end kept); "
                "see stats().truncated",
                self.max_length,
            )




def _reward_token(config: Any) -> list[int]:
    """``[config.reward_token_id]`` when the model names a reward token (InternLM2-Reward's ``get_score`` appends it
    and reads the score there), else ``[]``."""
    token = getattr(config, "reward_token_id", None)
    return [token] if isinstance(token, int) and not isinstance(token, bool) else []


def _keep_last_logits(model: Any) -> dict[str, Any]:
    """``{"logits_to_keep": 1}`` where the model's forward takes it (its LM head then runs at one position, not at
    every token: a judge reads the final norm's output instead), else nothing."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _uid(request: Any) -> str:
    return str(getattr(request, "uid", "?"))


def _default_device(use_gpu: bool) -> torch.device:
    """CPU unless ``use_gpu``; then the current CUDA device (a Ray GPU worker sees only its own GPU), found by torch
    alone, so the scorer runs where verl is not installed. verl is asked only when torch sees no CUDA device (another
    accelerator, such as an Ascend NPU)."""
    if not use_gpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    name = "cpu"
    try:
        from verl.utils.device import get_device_id, get_device_name

        name = get_device_name()
    except ImportError:
        pass
    if name == "cpu":
        raise RewardModelError("use_gpu=True but this process sees no accelerator. Fix: use_gpu=False for CPU runs")
    return torch.device(name, get_device_id())


def _check_dir(path: str | None, key: str) -> None:
    if not path or not os.path.isdir(path):
        import socket

        raise RewardModelError(
            f"{key}={path!r} is not a directory on host {socket.gethostname()}. Fix: the RM worker group loads models "
            "from local paths; put the model on every node of the reward pool (or on shared storage)"
        )


def _policy_id_limit(tokenizer: Any | None, path: str | None) -> int | None:
    """One past the largest id the policy can generate: ``len(tokenizer)``, or the ``vocab_size`` of the model's
    ``config.json`` next to it when larger (embedding rows padded past the tokenizer decode to no text)."""
    if tokenizer is None:
        return None
    limit = len(tokenizer)
    try:
        with open(os.path.join(str(path), "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        sizes = [config.get("vocab_size"), (config.get("text_config") or {}).get("vocab_size")]
        limit = max([limit, *(v for v in sizes if isinstance(v, int))])
    except (OSError, ValueError, AttributeError):  # a tokenizer-only directory
        pass
    return limit


def _stop_ids(tokenizer: Any, path: str) -> set[int]:
    """Ids that end a policy response: EOS and pad of the tokenizer, and the EOS ids of its generation config."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
    except OSError:  # no generation_config.json next to the tokenizer
        pass
    return {i for i in ids if i is not None}
