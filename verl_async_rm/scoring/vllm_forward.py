"""The RM's forwards on a vLLM pooling engine (``engine='vllm'``): prepared token ids in, one float score per row out.

:class:`VLLMForward` does for :class:`~verl_async_rm.scoring.scorer.RewardModelScorer` what
:class:`~verl_async_rm.scoring.forward.RMForward` does on transformers (``score_all``, ``forward_ids``, ``describe``,
``close``); the scorer still builds every input (re-templating, truncation, the reward token), so requests, batches,
deadlines and metrics are the same on both engines.

- The engine runs in the replica's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a killed replica takes its
  engine with it, and an engine that is broken (vLLM's ``EngineDeadError``, or a row that fails alone while a
  known-good input fails too: :class:`~verl_async_rm.errors.EngineDeadError`) ends the replica, which is then
  replaced as any lost replica.
- Raw scores: ``classify`` with ``use_activation=False`` gives the score head's outputs at the last token (vLLM's
  ``LAST`` pooling, where the transformers path reads them too), before any sigmoid or softmax.
- A call whose rows vLLM refuses or fails on is halved until the failing row is alone; the other rows keep scores.
- GRPO siblings share their prompt through vLLM's prefix cache (``enable_prefix_caching``), not the plugin's packing.
- On CPU the engine's KV cache defaults to ``VLLM_CPU_KVCACHE_SPACE=1`` GiB and its threads are not bound to cores
  (``VLLM_CPU_OMP_THREADS_BIND=nobind``; vLLM's default binds every engine to core 0); set them to override.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from verl_async_rm.errors import EngineDeadError, RewardModelError
from verl_async_rm.scoring.readout import reduce_outputs
from verl_async_rm.scoring.rm_config import RMConfig

logger = logging.getLogger(__name__)

__all__ = ["VLLMForward", "check_tolerance", "vllm_version"]

#: Largest |vLLM - transformers| the load-time check accepts, relative to max(1, |transformers' score|), by dtype.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}
#: GPU memory share of a vLLM replica's engine (the replica's GPU is its own).
GPU_MEMORY_UTILIZATION = 0.85


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when it cannot be imported."""
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return str(getattr(vllm, "__version__", "?"))


def check_tolerance(dtype: torch.dtype) -> float:
    """The load-time check's tolerance for an RM in ``dtype`` (see :data:`TOLERANCE`)."""
    return TOLERANCE.get(dtype, 5e-2)


class VLLMForward:
    """A vLLM pooling engine for one outcome sequence-classification RM, in this process.

    Args:
        config: the RM settings (path, dtype, score_reduction / score_index, micro_batch_max_tokens).
        max_length: the longest input the scorer builds (the engine's ``max_model_len``; None: the model's).
        dtype: the RM's resolved dtype; ``device``: where the replica runs (``cpu`` or its one GPU).
        prefix_caching: vLLM's prefix cache (GRPO siblings' common prompt computed once); off for benchmarks.
    """

    #: vLLM's runner: ``pooling`` here (scores), ``generate`` for a judge that writes its verdict.
    runner = "pooling"

    def __init__(self, config: RMConfig, *, max_length: int | None, dtype: torch.dtype, device: torch.device,
                 prefix_caching: bool = True) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives and dies with this replica
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM, PoolingParams

        self.config = config
        start = time.perf_counter()
        options: dict[str, Any] = {}
        if device.type != "cpu":
            options["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        self.llm = LLM(
            model=config.model_path,
            runner=self.runner,
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_length,
            max_num_batched_tokens=max(config.micro_batch_max_tokens, max_length or 0),
            enable_prefix_caching=prefix_caching,
            enforce_eager=device.type == "cpu",
            seed=0,
            **options,
        )
        self._params = PoolingParams(use_activation=False)
        #: Ids the engine is known to score (the scorer sets the load-time check's first input): when a row fails
        #: alone and this fails too, the engine is dead, not the row.
        self.canary: list[int] | None = None
        self.start_s = time.perf_counter() - start

    def describe(self) -> dict[str, Any]:
        """How forwards run: ``{"packing": "vllm", "vllm": version}`` (vLLM batches and caches prefixes itself)."""
        return {"packing": "vllm", "vllm": vllm_version()}

    def close(self) -> None:
        """Stop the engine and free its memory."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - shutting down: the engine may be gone already
                logger.debug("vLLM engine shutdown", exc_info=True)
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def score_all(
        self,
        inputs: Sequence[list[int]],
        max_tokens: int,
        groups: Sequence[Hashable | None] | None = None,
        reads: Sequence[Sequence[int]] | None = None,
    ) -> list[Any]:
        """One entry per input, in order: its score (a float), or the :class:`RewardModelError` of a row the engine
        refused or failed on. ``max_tokens`` and ``groups`` are the engine's business (its own batching and prefix
        cache); ``reads`` must be None (outcome RMs only)."""
        if reads is not None:
            raise RewardModelError("the vLLM engine scores outcome RMs only (no per-step reads)")
        return self._rows(list(inputs)) if inputs else []

    def forward_ids(self, batch: Sequence[Sequence[int]], *_: Any) -> torch.Tensor:
        """Scores (float32, one per row) of prepared input ids, in one engine call (raises on any failure)."""
        return torch.tensor(self._run(batch), dtype=torch.float32)

    def _rows(self, rows: list[list[int]]) -> list[Any]:
        try:
            return self._run(rows)
        except EngineDeadError:
            raise
        except Exception as err:  # noqa: BLE001 - a row vLLM refuses or fails on: find it, score the others
            if len(rows) == 1:
                self._check_alive(err)
                logger.error("vLLM failed on a %d-token RM input: %r", len(rows[0]), err)
                failure = RewardModelError(f"vLLM failed on this {len(rows[0])}-token input: {err}")
                failure.__cause__ = err
                return [failure]
            logger.warning("vLLM failed on %d rows (%r); retrying in halves", len(rows), err)
            half = len(rows) // 2
            return self._rows(rows[:half]) + self._rows(rows[half:])

    def _check_alive(self, err: Exception) -> None:
        """After a row failed alone: if the known-good :attr:`canary` fails too, the engine is broken, not the row
        (an in-process engine does not say so itself): raise :class:`EngineDeadError`."""
        if self.canary is None:
            return
        try:
            self._run([self.canary])
        except Exception as probe:  # noqa: BLE001 - any failure on the known-good input
            raise EngineDeadError(
                f"the vLLM engine of this replica fails on a known-good input too ({probe!r}), after {err!r}"
            ) from probe

    def _run(self, rows: Sequence[Sequence[int]]) -> list[Any]:
        """One engine call for ``rows``: their raw scores (raises on any failure)."""
        from vllm.inputs import TokensPrompt

        outputs = self._engine_call(lambda llm: llm.classify(
            [TokensPrompt(prompt_token_ids=list(ids)) for ids in rows], pooling_params=self._params, use_tqdm=False
        ))
        logits = torch.tensor([out.outputs.probs for out in outputs], dtype=torch.float32)
        return reduce_outputs(logits, self.config.score_reduction, self.config.score_index).tolist()

    def _engine_call(self, call: Any) -> Any:
        """``call(llm)``; a closed or dead engine raises :class:`EngineDeadError`."""
        if self.llm is None:
            raise EngineDeadError("the vLLM engine of this replica is closed")
        try:
            return call(self.llm)
        except Exception as err:
            if _engine_dead(err):
                raise EngineDeadError(f"the vLLM engine of this replica died: {err!r}") from err
            raise


def _engine_dead(err: BaseException) -> bool:
    """Whether ``err`` says the engine itself is gone (vLLM's ``EngineDeadError``), not that a row is bad."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead
    except ImportError:  # another vLLM layout: only our own closed-engine error counts
        return False
    return isinstance(err, VLLMEngineDead)
