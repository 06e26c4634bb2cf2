"""The transformers engine: token ids in, one float32 value per row (or per read position) out. Micro-batches run
padded or packed (:mod:`.packing`), read where the kind says (:mod:`.readout`). On CUDA padded forwards skip cuDNN
attention, which plans every new (rows, width) shape (0.3-1.9 s each on an H100; RL lengths change every step)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from verl_async_rm.errors import ConfigValueError, RewardModelError
from verl_async_rm.scoring.engine import Engine, Row, check_rows, differs
from verl_async_rm.scoring.inputs import plan_micro_batches, plan_packed_micro_batches
from verl_async_rm.scoring.readout import (check_output_field, field_scores, last_token_logits, per_token_logits,
                                           read_index, reduce_outputs)
from verl_async_rm.scoring.packing import (VARLEN_ATTENTION, choose_kernel, flat_ids, pack_rows,
                                           register_varlen_attention, to_device, varlen_kernel_name)
from verl_async_rm.scoring.sharing import MIN_SHARED_PREFIX, plan_shared_micro_batches, shared_layout

logger = logging.getLogger(__name__)

__all__ = ["TransformersEngine"]

#: Rows of the load-time packing check (token counts); short, so the check costs one tiny forward per row. The
#: second row is the first one's sibling: its first 6 tokens, then 3 of its own.
_CHECK_ROWS = (9, 9, 4, 6)
_CHECK_GROUPS = ("g", "g", None, None)


class TransformersEngine(Engine):
    """Forward passes of one loaded model. ``head``: the module whose per-token output is read (None: the model's
    pooled ``logits``, padded only); ``share_prompts``: siblings' common prefix run once (``varlen`` kernel; ``auto``:
    on CUDA only, the CPU kernel pads attention); ``on_failure``: a sharded replica's failure agreement; ``transform``
    and ``forward_kwargs``: a judge's LM-head rows and ``logits_to_keep=1``."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module | None, *, device: torch.device, pad_id: int,
                 packing: str = "auto", score_reduction: str = "index", score_index: int = 0,
                 share_prompts: str = "auto", min_shared_prefix: int = MIN_SHARED_PREFIX,
                 output_field: str | None = None, label_index: int | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 forward_kwargs: dict[str, Any] | None = None) -> None:
        self.model, self.head, self.device, self.pad_id = model, head, device, pad_id
        self.transform, self.forward_kwargs = transform, dict(forward_kwargs or {})
        self.on_failure = on_failure
        self.score_reduction, self.score_index = score_reduction, score_index
        #: Read scores from this field of the model's output (custom outputs); forwards are then padded.
        self.output_field = output_field
        #: Process RMs: a read position's value is the softmax probability of this label (else reduce_outputs).
        self.label_index = label_index
        #: Rows per forward at most (1 when a custom output's batched scores differ from single rows').
        self.max_rows: int | None = None
        self.min_shared_prefix = min_shared_prefix
        #: Tokens the packed forwards computed, and those a shared prefix saved on top of them, since load.
        self.computed_tokens = self.saved_tokens = 0
        self._captured: torch.Tensor | None = None
        self._hook = head.register_forward_hook(self._capture) if head is not None else None
        self._original_attention = getattr(model.config, "_attn_implementation", None)
        #: 'varlen' (packed) or 'padded'.
        self.kernel, self.packing_reason = choose_kernel(
            model, device, packing, per_token_head=head is not None and output_field is None)
        # score_output_field, checked at load: a padded batch must score as its rows alone (the model's own code may
        # pick its last token by pad_token_id or ignore the mask), else one row per forward
        if output_field is not None:
            rows = check_rows(int(model.get_input_embeddings().num_embeddings), (7, 4))
            check_output_field(model, rows[0], output_field, score_reduction, score_index, device)
            single = torch.cat([self.forward_padded([ids]) for ids in rows])
            if self._check(self.forward_padded(rows), single, "batched") is not None:
                logger.warning("score_output_field=%s: %s scores a padded batch differently from single rows; scoring "
                               "one row per forward", output_field, type(model).__name__)
                self.max_rows = 1
        if packing == "true" and self.kernel == "padded":
            raise ConfigValueError("packing", "true", self.packing_reason.removeprefix("packing=true, but "),
                                   "use packing='auto' or 'false' (verl: +async_rm.packing=auto)")
        #: Whether siblings' common prefixes run once (needs the ``varlen`` kernel and a passing load-time check).
        self.share_prompts = False
        if self.packed:
            share = share_prompts == "true" or (share_prompts == "auto" and device.type == "cuda")
            # a process RM reads several positions per row: no shared prefix (its rows would be re-indexed)
            self._switch_to_packing(packing, share and label_index is None)
        logger.info("RM forwards: %s (%s); shared prompts %s", self.describe()["packing"], self.packing_reason,
                    "on" if self.share_prompts else "off")

    @property
    def packed(self) -> bool:
        """True when micro-batches run as one packed sequence each."""
        return self.kernel != "padded"

    def describe(self) -> dict[str, Any]:
        """``packing``: 'packed (varlen: <kernel>)' or 'padded'; and why."""
        what = f"packed (varlen: {varlen_kernel_name(self.device)})" if self.packed else "padded"
        info = {"packing": what, "packing_reason": self.packing_reason, "share_prompts": self.share_prompts}
        if self.output_field is not None:
            info["score_output_field"] = self.output_field
            info["rows_per_forward"] = self.max_rows or "any"
        return info

    def plan(self, inputs: Sequence[Sequence[int]], max_tokens: int, groups: Sequence[Hashable | None] | None = None
             ) -> list[list[int]]:
        """The micro-batches :meth:`score_all` runs (lists of indices into ``inputs``) within ``max_tokens``: real
        tokens when packed (with shared prompts and ``groups``, siblings kept together and their common prefix counted
        once), rows x longest row when padded."""
        if self.max_rows == 1:
            return [[i] for i in range(len(inputs))]
        if self._sharing(groups):
            assert groups is not None
            return plan_shared_micro_batches(inputs, groups, max_tokens, self.min_shared_prefix)
        lengths = [len(ids) for ids in inputs]
        return (plan_packed_micro_batches if self.packed else plan_micro_batches)(lengths, max_tokens)

    def close(self) -> None:
        """Remove the head hook and give the model its own attention back (a model shared with other code)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.kernel == "varlen" and self._original_attention is not None:
            self.model.set_attn_implementation(self._original_attention)

    def score_all(self, inputs: Sequence[list[int]], max_tokens: int, groups: Sequence[Hashable | None] | None = None,
                  reads: Sequence[Sequence[int]] | None = None) -> list[Any]:
        """Values of ``inputs``, in order, by micro-batches of at most ``max_tokens``; a failure costs only its rows.
        ``reads``: per input the positions read (process RMs). One device sync per call: every micro-batch is launched
        before the values are copied, so the host builds the next input while the device runs."""
        results: list[Any] = [None] * len(inputs)
        share = self._sharing(groups) and reads is None
        launched: list[tuple[list[int], torch.Tensor]] = []
        for batch in self.plan(inputs, max_tokens, groups if share else None):
            rows = [inputs[j] for j in batch]
            batch_groups = [groups[j] for j in batch] if share else None  # type: ignore[index]
            batch_reads = [reads[j] for j in batch] if reads is not None else None
            try:
                launched.append((batch, self._forward(rows, batch_groups, batch_reads)))
            except Exception as err:  # out of memory, or a row that makes the forward raise: isolate it
                failed = [(ids, None if batch_groups is None else batch_groups[k],
                           None if batch_reads is None else batch_reads[k]) for k, ids in enumerate(rows)]
                for j, value in zip(batch, self._isolate(failed, err), strict=True):
                    results[j] = value
        if launched:
            order = [j for batch, _ in launched for j in batch]
            values = torch.cat([v for _, v in launched]).cpu().tolist()
            per_row = _per_row(values, None if reads is None else [reads[j] for j in order])
            for j, value in zip(order, per_row, strict=True):
                results[j] = value
        assert all(r is not None for r in results), "every input is in exactly one micro-batch"
        return results

    def forward_ids(self, batch: Sequence[Sequence[int]], groups: Sequence[Hashable | None] | None = None
                    ) -> torch.Tensor:
        """Scores (float32, on the host, one per row) of prepared input ids, in one forward pass."""
        return self._forward(batch, groups).cpu()

    def _forward(self, batch: Sequence[Sequence[int]], groups: Sequence[Hashable | None] | None,
                 reads: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """One forward pass, the scores left on the device (no sync): one per row, or with ``reads`` one per read
        position, row after row; ``groups`` lets siblings share their common prefix."""
        if self.packed:
            return self.forward_packed(batch, groups, reads)
        return self.forward_padded(batch, reads)

    def forward_padded(self, batch: Sequence[Sequence[int]], reads: Sequence[Sequence[int]] | None = None
                       ) -> torch.Tensor:
        """One right-padded forward; the score is read at each row's last unmasked token (or at ``reads``)."""
        lengths = np.fromiter((len(ids) for ids in batch), dtype=np.int64, count=len(batch))
        width = int(lengths.max())
        mask = np.arange(width) < lengths[:, None]
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        ids[mask] = flat_ids(batch, int(lengths.sum()))  # row-major: each row's tokens, then the next row's
        input_ids, attention_mask = to_device(ids, self.device), to_device(mask.astype(np.int64), self.device)
        self._captured = None
        plans: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.device.type == "cuda":  # sdpa without the cuDNN backend, which plans every new shape
            from torch.nn.attention import SDPBackend, sdpa_kernel

            plans = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        with torch.no_grad(), plans:
            output = self.model(input_ids=input_ids, attention_mask=attention_mask, **self.forward_kwargs)
            per_token, self._captured = self._captured, None
            if self.output_field is not None:
                return field_scores(output, self.output_field, len(batch), self.score_reduction, self.score_index)
            if per_token is None or per_token.dim() != 3 or per_token.shape[:2] != input_ids.shape:
                per_token = per_token_logits(output, input_ids.shape) if reads is not None else None
            if reads is not None:
                rows, positions = read_index(reads)
                logits = per_token[to_device(rows, per_token.device), to_device(positions, per_token.device)]
            elif per_token is not None:
                logits = last_token_logits(per_token, attention_mask)
            else:
                logits = getattr(output, "logits", None)
                if logits is None or logits.dim() != 2 or logits.shape[0] != len(batch):
                    raise RewardModelError(
                        f"the RM's output has no (batch, num_labels) logits (got {type(output).__name__}); "
                        "set score_head to the module that produces the scores, or score_output_field to the "
                        "output field that holds them")
            return self._values(logits)

    def forward_packed(self, batch: Sequence[Sequence[int]], groups: Sequence[Hashable | None] | None = None,
                       reads: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """One packed forward: rows concatenated, positions restarting per row, scores at each row's last token (or
        at ``reads``). With shared prompts and ``groups``, siblings' common prefix runs once (:func:`shared_layout`)."""
        layout = None
        if self.share_prompts and groups is not None and reads is None:
            layout = shared_layout(batch, groups, self.device, self.min_shared_prefix)
            if layout.saved == 0:
                layout = None  # nothing shared: the plain layout needs no key gather
        rows = layout or pack_rows(batch, self.device)
        kwargs: dict[str, Any] = {"input_ids": rows.input_ids, "position_ids": rows.position_ids, "use_cache": False,
                                  **self.forward_kwargs}
        kwargs.update(rows.varlen_kwargs() if layout is None else layout.attention_kwargs())
        self._captured = None
        with torch.no_grad():
            self.model(**kwargs)
            per_token, self._captured = self._captured, None
            if per_token is None or per_token.dim() != 3 or tuple(per_token.shape[:2]) != tuple(rows.input_ids.shape):
                raise RewardModelError(
                    "packed forward: the score head gave no per-token output to read each row's last token from; "
                    "set packing='false' (verl: +async_rm.packing=false)")
            if reads is None:
                index = rows.last
            else:
                row_of, positions = read_index(reads)
                starts = np.cumsum([0, *(len(ids) for ids in batch)])[:-1]
                index = to_device(starts[row_of] + positions, self.device)
            logits = per_token[0].index_select(0, index)
            scores = self._values(logits)
        computed = int(rows.input_ids.shape[1])
        self.computed_tokens += computed
        self.saved_tokens += sum(len(ids) for ids in batch) - computed
        return scores

    def _sharing(self, groups: Sequence[Hashable | None] | None) -> bool:
        return self.share_prompts and groups is not None and any(g is not None for g in groups)

    def _values(self, logits: torch.Tensor) -> torch.Tensor:
        """One value per read row of ``(M, L)`` head outputs: the label's probability (process RMs) or
        :func:`reduce_outputs`."""
        if self.label_index is not None:
            return torch.softmax(logits.float(), dim=-1)[:, self.label_index]
        if self.transform is not None:
            logits = self.transform(logits)
        return reduce_outputs(logits, self.score_reduction, self.score_index)

    def _run(self, rows: list[Row]) -> list[Any]:
        groups = [g for _, g, _ in rows] if any(g is not None for _, g, _ in rows) else None
        reads = [r for _, _, r in rows] if rows[0][2] is not None else None
        return _per_row(self._forward([ids for ids, _, _ in rows], groups, reads).cpu().tolist(), reads)

    def _failed(self, rows: list[Row], err: Exception) -> list[Any] | None:
        if self.on_failure is not None:  # a sharded replica retries only when every rank failed alike
            self.on_failure(err)
        if isinstance(err, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError itself since torch 2.5
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(rows) == 1:
                failure = RewardModelError(f"out of memory on a {len(rows[0][0])}-token input: {err}")
                failure.__cause__ = err
                return [failure]
        elif isinstance(err, RewardModelError):  # the model's output cannot be read: no row is to blame
            return [err] * len(rows)
        return None

    def _capture(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._captured = output if isinstance(output, torch.Tensor) else None

    def _switch_to_packing(self, mode: str, share_prompts: bool) -> None:
        """Pack only if packed scores of a few short rows (and, with ``share_prompts``, of a sibling pair sharing its
        prefix) equal single-row padded ones computed with the model's own attention. A mismatch or an error (custom
        modelling code, a bidirectional encoder...): ``auto`` falls back to padded forwards, ``true`` raises."""
        rows = check_rows(int(self.model.get_input_embeddings().num_embeddings), _CHECK_ROWS)
        rows[1][:6] = rows[0][:6]
        try:
            reference = torch.cat([self.forward_padded([ids]) for ids in rows])
            register_varlen_attention()
            self.model.set_attn_implementation(VARLEN_ATTENTION)
            if self.model.config._attn_implementation != VARLEN_ATTENTION:
                raise RuntimeError(f"the model kept attn_implementation={self.model.config._attn_implementation}")
            problem = self._check(self.forward_packed(rows), reference, "packed")
        except Exception as err:  # the model's code refused the packed call
            problem = f"a packed forward failed: {err!r}"
        if problem is None:
            if share_prompts:
                self.share_prompts, minimum, self.min_shared_prefix = True, self.min_shared_prefix, 1
                try:
                    shared = self._check(self.forward_packed(rows, _CHECK_GROUPS), reference, "shared-prompt")
                except Exception as err:
                    shared = f"a shared-prompt forward failed: {err!r}"
                self.min_shared_prefix = minimum
                if shared is not None:
                    logger.warning("%s; scoring without shared prompts", shared)
                    self.share_prompts = False
            self.computed_tokens = self.saved_tokens = 0
            return
        self.model.set_attn_implementation(self._original_attention)
        if mode == "true":
            raise ConfigValueError("packing", "true",
                                   f"{type(self.model).__name__} does not score packed rows correctly ({problem})",
                                   "use packing='auto' or 'false' (verl: +async_rm.packing=auto)")
        logger.warning("packing=auto: %s; using padded forwards", problem)
        self.kernel, self.packing_reason = "padded", f"packing={mode}, but {problem}"

    def _check(self, got: torch.Tensor, reference: torch.Tensor, what: str) -> str | None:
        half = next(self.model.parameters()).dtype in (torch.bfloat16, torch.float16)
        return differs(got.tolist(), reference.tolist(), half, f"{what} scores")


def _per_row(values: list[float], reads: Sequence[Sequence[int]] | None) -> list[Any]:
    """Scores copied to the host by ``.tolist()`` (Python floats: the one conversion of a score), one entry per row:
    a float, or with ``reads`` the values of the row's read positions."""
    if reads is None:
        return values
    ends = np.cumsum([len(r) for r in reads]).tolist()
    assert not ends or ends[-1] == len(values), "one value per read position"
    return [values[end - len(r) : end] for r, end in zip(reads, ends, strict=True)]
