"""``--rm tiny``: fit the RM cost model ``a + b * padded_tokens`` to forwards of the real tiny RM on this CPU.

Builds the offline tiny models (:func:`verl_async_rm.testing.models.build_tiny_models`), loads the tiny RM with the
package's own :class:`~verl_async_rm.scoring.scorer.RewardModelScorer` (float32, CPU, every core torch is given) and
times ``forward_ids`` on right-padded random batches of several sizes and lengths: one warm-up forward per shape, then
``reps`` rounds that each time every shape once (interleaved, so a burst of load from other processes hits all shapes
alike). ``a`` and ``b`` are the least-squares line through (padded tokens, fastest time of the shape), clipped at 0:
on a shared machine the fastest of several timings is the least disturbed one (the medians are recorded too). The tiny
RM knows at most 2048 positions, so longer workload items are costed by extrapolating the line.

The overlap benchmark then runs its policies on the simulated RM with the fitted ``a`` and ``b``: the real tiny RM is
measured, not run inside the policies (on this machine R replicas would share 2 CPU cores, which no real deployment
does, and real forwards could not be scaled to the benchmark's time scale).
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from typing import Any

from verl_async_rm.bench.workload import RMCostModel

__all__ = ["SHAPES", "calibrate_tiny_rm", "fit_line"]

logger = logging.getLogger(__name__)

#: (batch size, tokens per row) of the timed forwards.
SHAPES = ((1, 64), (1, 512), (1, 2048), (4, 64), (4, 256), (4, 1024), (16, 64), (16, 256), (16, 1024))


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b, r2)``. Needs two distinct ``x``."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("fit_line needs as many ys as xs and at least two distinct xs")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, (1.0 - ss_res / ss_tot) if ss_tot > 0 else 1.0


def calibrate_tiny_rm(
    *, reps: int = 5, seed: int = 0, cache_dir: str | None = None,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
) -> tuple[RMCostModel, dict[str, Any]]:
    """Time the tiny RM and return the fitted cost model and the calibration record (samples, fit, r2).

    ``shapes``: (batch size, tokens per row) pairs to time; at least two distinct padded sizes.
    """
    if reps < 1 or len({size * length for size, length in shapes}) < 2:
        raise ValueError(f"calibrate_tiny_rm needs reps >= 1 and shapes of two or more padded sizes, got reps={reps}, "
                         f"shapes={shapes}")
    import torch

    from verl_async_rm.scoring.rm_config import RMConfig
    from verl_async_rm.scoring.scorer import RewardModelScorer
    from verl_async_rm.testing.models import build_tiny_models

    models = build_tiny_models(cache_dir)
    scorer = RewardModelScorer(RMConfig(model_path=str(models.rm), retemplate="never"), device="cpu")
    vocab = int(scorer.model.config.vocab_size)
    rng = random.Random(seed)
    batches = [[[rng.randrange(3, vocab) for _ in range(length)] for _ in range(size)] for size, length in shapes]
    for batch in batches:
        scorer.forward_ids(batch)  # warm-up
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(reps):
        for k, batch in enumerate(batches):
            t0 = time.perf_counter()
            scorer.forward_ids(batch)
            times[k].append(time.perf_counter() - t0)
    samples = [{"batch_size": size, "tokens_per_row": length, "padded_tokens": size * length,
                "min_s": min(ts), "median_s": statistics.median(ts)} for (size, length), ts in zip(shapes, times)]
    for sample in samples:
        logger.info("tiny RM forward %dx%d: fastest %.1f ms, median %.1f ms", sample["batch_size"],
                    sample["tokens_per_row"], sample["min_s"] * 1e3, sample["median_s"] * 1e3)
    a, b, r2 = fit_line([s["padded_tokens"] for s in samples], [s["min_s"] for s in samples])
    a, b = max(a, 0.0), max(b, 0.0)
    if a == 0.0 and b == 0.0:
        raise RuntimeError(f"tiny RM calibration gave a non-increasing, non-positive line: {samples}")
    source = (f"tiny RM fit on this CPU ({torch.get_num_threads()} torch threads, float32): "
              f"a={a * 1e3:.2f} ms, b={b * 1e6:.2f} us/token, r2={r2:.3f}")
    record = {"model_path": str(models.rm), "torch_threads": torch.get_num_threads(), "reps": reps,
              "samples": samples, "a_s": a, "b_s_per_token": b, "r2": r2}
    return RMCostModel(a_s=a, b_s_per_token=b, source=source), record
