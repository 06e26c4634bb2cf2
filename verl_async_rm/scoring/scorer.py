"""The reward model in one process: one kind composed with one engine. No Ray, so it runs in-process in tests and
benchmarks."""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from verl_async_rm.errors import RewardModelError
from verl_async_rm.request import RMRequest, ScoreResult
from verl_async_rm.scoring.batch import KindBatch, ScorerStats, stat_names
from verl_async_rm.scoring.checkpoint import check_rm_checkpoint, load_reward_model, load_tokenizer
from verl_async_rm.scoring.engine import check_rows, differs
from verl_async_rm.scoring.transformers_engine import TransformersEngine
from verl_async_rm.scoring.offload import Move, WeightOffload
from verl_async_rm.scoring.rm_config import JUDGE_KINDS, RMConfig, kind_class
from verl_async_rm.scoring.sharding import (WEIGHTS_SHARE, FailureAgreement, ShardGroup, check_same_forward, join_group,
                                            load_sharded, rm_weights_bytes)
from verl_async_rm.step_counter import StepCounter

logger = logging.getLogger(__name__)

__all__ = ["RewardModelScorer", "ScorerStats", "resolve_dtype"]

#: Lengths of the rows of the vLLM engine's load-time check.
_CHECK_LENGTHS = (9, 4, 6)


def resolve_dtype(name: str, on_gpu: bool) -> torch.dtype:
    """``RMConfig.dtype`` as a torch dtype ('auto': bfloat16 on GPU, float32 on CPU)."""
    if name == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


class RewardModelScorer:
    """An RM ready to score :class:`RMRequest` batches. ``device``: default the current CUDA device with
    ``use_gpu``, else CPU (no verl import); ``shard``, ``store``: this rank of a sharded replica."""

    def __init__(self, config: RMConfig, device: str | torch.device | None = None, shard: ShardGroup | None = None,
                 store: Any = None) -> None:
        self.config = config
        self.device = torch.device(device if device is not None else _default_device(config.use_gpu))
        self.dtype = resolve_dtype(config.dtype, self.device.type != "cpu")
        _check_dir(config.model_path, "model_path")
        if config.retemplate != "never":
            _check_dir(config.policy_tokenizer_path, "policy_tokenizer_path")
        check_rm_checkpoint(config.model_path, config.trust_remote_code, config.reward_kind, config.kind_given)
        self.rm_tokenizer = load_tokenizer(config.model_path, "model_path", config.trust_remote_code)
        kind = kind_class(config)
        self.model, self.sharding, agreement = None, {"sharding": "none"}, None
        #: a vLLM pooling RM too large for one device has no transformers reference (see :meth:`_start_vllm`)
        self.transformers_reference = (config.engine == "vllm" and not kind.needs_vllm
                                       and fits_one_device(config, self.device))
        if kind.needs_vllm or (config.engine == "vllm" and not self.transformers_reference):  # no transformers model
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(config.model_path, trust_remote_code=config.trust_remote_code)
            vocab_size = int(_text_config(model_config).vocab_size)
        else:
            self.model, agreement = self._load(shard, store)
            model_config = self.model.config
            vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.num_labels = int(getattr(model_config, "num_labels", 1)) if self.model is not None else 1
        self.kind = kind(config, self.rm_tokenizer, _text_config(model_config), vocab_size)
        # padding positions are masked out, so the pad id only has to be a valid token id
        self.pad_id = next((i for i in (self.rm_tokenizer.pad_token_id, self.rm_tokenizer.eos_token_id)
                            if i is not None), 0)
        self.engine: Any = None
        self.engine_reason = "engine='transformers'"
        if self.model is not None:
            readout = self.kind.transformers_readout(self.model)
            text_config = _text_config(self.model.config)
            if readout["head"] is not None and getattr(text_config, "pad_token_id", None) is None:
                text_config.pad_token_id = self.pad_id  # HF refuses batches > 1 without one; scores are read by mask
            self.engine = TransformersEngine(self.model, device=self.device, pad_id=self.pad_id, packing=config.packing,
                                   score_reduction=config.score_reduction, score_index=config.score_index,
                                   share_prompts=config.share_prompts, on_failure=agreement, **readout)
            if shard is not None:
                check_same_forward(self.engine.describe())
            self.kind.verify(self.engine)
        if config.engine == "vllm" or kind.needs_vllm:
            self._start_vllm()
        self._counts = StepCounter(stat_names(config))
        self._warned_truncation = False
        self._offloader: WeightOffload | None = None  # made at the first sleep (placement='policy_pool')
        logger.info("RM %s (%s) loaded on %s (%s, head=%s, max_length=%s, retemplate=%s, forwards %s%s)",
                    config.model_path, self.kind.name, self.device, self.dtype, self.kind.head_name,
                    self.kind.max_length, self.kind.retemplate, self.engine.describe()["packing"],
                    f", reward token {self.kind.suffix_ids} appended" if self.kind.suffix_ids else "")

    def _load(self, shard: ShardGroup | None, store: Any) -> tuple[Any, FailureAgreement | None]:
        """The transformers model, sharded over ``shard``'s ranks if given (every rank runs this, in step)."""
        config = self.config

        def load(**kwargs: Any) -> Any:
            return load_reward_model(config.model_path, trust_remote_code=config.trust_remote_code,
                                     attn_implementation=config.attn_implementation, reward_kind=config.reward_kind,
                                     kind_given=config.kind_given, dtype=self.dtype, **kwargs)

        agreement = None
        if shard is None:
            model = load().to(self.device)
        else:
            store = join_group(shard, self.device, store)
            agreement = FailureAgreement(store, shard.rank, shard.world_size)
            model, self.sharding = load_sharded(load, config.model_path, config.trust_remote_code, self.device,
                                                shard.world_size)
        model.config.use_cache = False
        return model.eval().requires_grad_(False), agreement

    def _start_vllm(self) -> None:
        """Move the forwards to a vLLM engine. Its load-time check: it runs the check rows, and for an outcome RM it
        scores them as the transformers forward did, within :func:`~.engine.differs`. An outcome RM whose weights
        exceed one device (``gpus_per_replica > 1``) has no transformers reference: its rows must score finite and
        alike alone and in one batch. Else the replica refuses to load (``RewardModelError``)."""
        from verl_async_rm.scoring.vllm_engine import VLLMEngine, vllm_version

        rows = check_rows(self.kind.vocab_size, _CHECK_LENGTHS)
        reference = None
        pooling = self.config.engine == "vllm" and not self.kind.needs_vllm
        key, value, fix = (("engine", "vllm", "use engine='transformers'") if pooling else
                           ("reward_kind", "group_judge", "serve the judge at an endpoint (endpoint)")
                           if self.config.reward_kind == "group_judge" else
                           ("judge_readout", "generate", "use judge_readout='logits'"))
        where = f"{key}={value!r} for the RM at {self.config.model_path}"
        if not self.transformers_reference and pooling:
            self.kind.head_name = "vLLM pooling (the model's classification head)"
        if self.engine is not None:
            if self.kind.head_name != "score":
                raise RewardModelError(f"{where}: vLLM reads a 'score' head; this RM's scores come from "
                                       f"{self.kind.head_name!r}. Fix: {fix}")
            reference = [self.engine.score_batch([ids])[0] for ids in rows]
            self.engine.close()
            self.engine = self.model = None  # the engine gets the device's memory
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        engine = None
        try:
            engine = VLLMEngine(self.config, max_length=self.kind.max_length, dtype=self.dtype, device=self.device,
                                generate=not pooling)
            got = engine.score_all(rows, self.config.micro_batch_max_tokens)
            failed = next((v for v in got if isinstance(v, Exception)), None)
            problem = None if failed is None else f"vLLM could not run the RM: {failed!r}"
            if problem is None and pooling and reference is None:  # the smaller check: batched as alone
                reference = [engine.score_all([ids], self.config.micro_batch_max_tokens)[0] for ids in rows]
                if differs(got, reference, True, ""):
                    problem = f"vLLM scores the load-time check inputs {got} batched and {reference} alone"
            elif problem is None and reference is not None and differs(got, reference, self.dtype != torch.float32,
                                                                       ""):
                problem = (f"vLLM scores the load-time check inputs differently from transformers: {got} against "
                           f"{reference}")
        except Exception as err:  # noqa: BLE001 - an architecture, kernel or setting vLLM refuses: say which
            problem = f"vLLM could not {'load' if engine is None else 'run'} the RM: {err!r}"
        if problem is not None:
            if engine is not None:
                engine.close()
            raise RewardModelError(f"{where}: {problem}. Fix: {fix}")
        engine.canary = rows[0]
        self.engine = engine
        if not pooling:
            self.engine_reason = f"{key}={value!r} (vLLM {vllm_version()})"
        else:
            diff = max(abs(a - b) for a, b in zip(got, reference, strict=True))
            checked = (f"as transformers within {diff:.2g}" if self.transformers_reference else
                       f"finite and alike batched and "
                       f"alone (within {diff:.2g}); no transformers reference: the weights exceed one device")
            self.engine_reason = f"vLLM {vllm_version()} scores the {len(rows)} load-time check inputs {checked}"
        logger.info("RM %s: engine vllm (%s; started in %.1f s)", self.config.model_path, self.engine_reason,
                    engine.start_s)

    def prepare(self, request: RMRequest) -> tuple[list[int], bool]:
        """The RM input ids for ``request`` and whether they were truncated (raises :class:`RewardInputError`)."""
        built = self.kind.build(request)
        return built.ids, built.truncated

    def score(self, requests: Sequence[RMRequest]) -> list[ScoreResult]:
        """One entry per request: its :data:`~verl_async_rm.request.Score`, or the error that kept that request from
        being scored; a bad request fails only its own entry, the call itself does not raise."""
        start = time.perf_counter()
        batch = KindBatch(self.kind, requests)
        reads = [b.reads for b in batch.inputs] if batch.inputs and batch.inputs[0].reads is not None else None
        schemas = {"schemas": [b.schema for b in batch.inputs]} if any(b.schema is not None for b in batch.inputs) \
            else {}
        raws = self.engine.score_all([b.ids for b in batch.inputs], self.config.micro_batch_max_tokens, batch.groups,
                                     reads, **schemas)
        results, counts = batch.read(raws)
        self._counts.add_all({**counts, "busy_s": time.perf_counter() - start})
        if counts["truncated"] and not self._warned_truncation:
            self._warned_truncation = True
            logger.warning("RM inputs longer than max_length=%s are being truncated (prompt start cut, response end "
                           "kept); see stats().truncated", self.kind.max_length)
        return results

    def forward_ids(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores (float32, one per row) of already prepared input ids, in one transformers forward."""
        return self.engine.forward_ids(batch)

    def describe(self) -> dict[str, Any]:
        """What this scorer serves: device, dtype, retemplating, max_length, outputs, and how forwards run."""
        return {
            "device": str(self.device), "dtype": str(self.dtype), "retemplate": self.kind.retemplate,
            "max_length": self.kind.max_length, "num_labels": self.num_labels,
            "engine": "transformers" if isinstance(self.engine, TransformersEngine) else "vllm",
            "engine_reason": self.engine_reason,
            **({"judge_readout": self.config.judge_readout} if self.config.reward_kind in JUDGE_KINDS else {}),
            **self.sharding, **self.engine.describe()}

    def sleep(self) -> Move:
        """Release the device's memory: the weights to host memory (``placement='policy_pool'``, while the policy
        trains); :meth:`score` must not run until :meth:`wake`."""
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
        """Counters since load."""
        return ScorerStats(**self._counts.totals())

    def pop_step_stats(self) -> ScorerStats:
        """Counters since the last call (one training step); truncations are logged here, once; then reset."""
        step = ScorerStats(**self._counts.pop_step())
        if step.truncated:
            logger.warning("RM step: %d of %d inputs truncated to max_length=%s (prompt start cut, response end "
                           "kept); %d failed", step.truncated, step.requests, self.kind.max_length, step.failed)
        return step


def fits_one_device(config: RMConfig, device: torch.device) -> bool:
    """Whether the RM's weights fit one device of the replica (always on CPU, and for one GPU per replica: the
    memory check passed), so that a transformers copy can be the vLLM engine's load-time reference."""
    if config.gpus_per_replica == 1 or device.type != "cuda":
        return True
    sized = rm_weights_bytes(config)
    return sized is None or sized[0] <= WEIGHTS_SHARE * torch.cuda.get_device_properties(device).total_memory


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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
            "from local paths; put the model on every node of the reward pool (or on shared storage)")
