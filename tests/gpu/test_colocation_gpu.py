"""The layout model's key assumption, measured on one CUDA GPU: what an RM prefill beside a decoding policy costs each
of them, and what a sleep and a wake of an 8B RM take (``verl-async-rm bench layout``'s ``--share-slowdown``,
``--share-slowdown-tail``, ``--host-gbps`` and ``--rm-weight-gb``).

Both models are random-weight Llama-3.1-8B shapes built on the GPU from ``SHAPES['llama8b']`` (nothing is
downloaded; throughput does not depend on the weights): a causal LM stands in for a 7B policy, a one-output
sequence-classification model is the RM. In bf16 they take ~31 GB together.

- Decode: ``DECODE_STEPS`` greedy steps of a batch of ``b`` sequences after a ``PROMPT``-token prefill, through the
  HF model with its KV cache, at a small batch (the rollout's tail) and a large one. Eager, with no CUDA graphs, a
  small batch may wait on the host's kernel launches: the record gives the decode's kernel time over wall time
  (``decode_gpu_busy_share``, torch.profiler) and flags ``launch_bound`` below 0.8.
- RM: forwards of ``RM_ROWS x RM_WIDTH`` tokens, back to back.
- Side by side: the RM loops in another CUDA stream of this process (kernels of two streams may run at once) or in
  another process (without MPS the GPU time-slices two processes) while the decode runs; the RM tokens/s beside the
  decode counts the RM forwards' tokens prorated to the decode's window.
- The model's parameter: ``s = (1 - D1 / D0) / (R1 / R0)``: the fraction of the decode's time lost per second of RM
  work (``D``: decode tokens/s, ``R``: RM tokens/s, ``0`` alone, ``1`` side by side). 1 is time-slicing, 0 a free RM;
  above 1 sharing is worse than taking turns.
- Sleep and wake: the plugin's own :class:`~verl_async_rm.scoring.offload.WeightOffload` (every weight to pinned
  host memory, the device's copy freed, and back), and the naive ``model.to('cpu')`` / ``model.to('cuda')``
  (pageable memory); the weights are checked unchanged after the wake.

The sleep and wake tests come first: they take seconds, the decode runs take most of the module's time.

Figures are logged and written to ``colocation_gpu.json`` (in ``$VERL_ASYNC_RM_GPU_OUT`` if set, else a pytest temp
folder: the log names it). Only sanity is asserted (positive, finite figures; weights back intact): never a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_async_rm.bench.rm_model import build_random_causal_lm, build_random_rm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHAPE = "llama8b"
PROMPT = 512
DECODE_STEPS = 128
DECODE_BATCHES = {"tail": 4, "saturated": 64}  # -> --share-slowdown-tail, --share-slowdown
RM_ROWS, RM_WIDTH = 8, 1024
RM_REPS = 5


def build_causal_lm(shape: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A random-weight causal LM of a ``SHAPES`` shape, built on ``device``."""
    return build_random_causal_lm(shape, device, dtype)


def _new_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _wait(stream: Any) -> None:
    """Wait for this stream's work only (a device-wide sync would also wait for the other stream's RM)."""
    if stream is not None:
        stream.synchronize()


def _ids(model: Any, rows: int, width: int, device: torch.device, seed: int) -> torch.Tensor:
    """Random token ids in [3, min(vocab, 32000)): no pad (0), bos or eos."""
    generator = torch.Generator().manual_seed(seed)
    top = min(int(model.config.vocab_size), 32000)
    return torch.randint(3, top, (rows, width), generator=generator).to(device)


def decode_run(model: Any, batch: int, device: torch.device, stream: Any, steps: int = DECODE_STEPS,
               prompt: int = PROMPT, around_steps: Any = contextlib.nullcontext) -> dict[str, float]:
    """``steps`` greedy decode steps of ``batch`` sequences after a ``prompt``-token prefill: tokens/s over the steps
    and their window (``time.monotonic``, comparable across processes). ``around_steps()`` wraps the steps only."""
    with _on(stream), torch.inference_mode():
        out = model(input_ids=_ids(model, batch, prompt, device, seed=batch), use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        _wait(stream)
        with around_steps():
            start = time.monotonic()
            for _ in range(steps):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            _wait(stream)
            end = time.monotonic()
    return {"tok_s": batch * steps / (end - start), "start": start, "end": end}


def gpu_busy_share(model: Any, batch: int, device: torch.device, steps: int = 16) -> float | None:
    """Kernel time over wall time of ``steps`` decode steps alone (torch.profiler): well below 1, the eager HF decode
    waits on the host's kernel launches, and its slowdown beside the RM understates a CUDA-graph engine's (vLLM's).
    None where the profiler cannot say (logged)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        run = decode_run(model, batch, device, _new_stream(device), steps=steps, around_steps=lambda: prof)
        kernel_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                        for e in prof.key_averages())
    except (RuntimeError, AttributeError, ImportError) as err:  # a measurement aid: recorded as None, logged
        logger.warning("gpu_busy_share: the profiler gave no kernel times (%r)", err)
        return None
    return kernel_us / 1e6 / (run["end"] - run["start"])


def rm_forward(model: Any, ids: torch.Tensor, stream: Any) -> None:
    with _on(stream), torch.inference_mode():
        model(input_ids=ids).logits.float()
    _wait(stream)


def rm_alone_tok_s(model: Any, ids: torch.Tensor, stream: Any, reps: int = RM_REPS) -> float:
    """Best of ``reps`` back-to-back forwards, after a warm-up."""
    rm_forward(model, ids, stream)
    best = math.inf
    for _ in range(reps):
        start = time.monotonic()
        rm_forward(model, ids, stream)
        best = min(best, time.monotonic() - start)
    return ids.numel() / best


def tokens_in_window(spans: list[tuple[float, float]], tokens: int, start: float, end: float) -> float:
    """RM tokens done in ``[start, end]``: each forward's tokens prorated by its overlap with the window."""
    done = 0.0
    for a, b in spans:
        overlap = min(b, end) - max(a, start)
        if overlap > 0 and b > a:
            done += tokens * overlap / (b - a)
    return done


def share_slowdown(decode_alone: float, decode_beside: float, rm_alone: float, rm_beside: float) -> float:
    """``(1 - D1/D0) / (R1/R0)``: decode time lost per second of RM work (inf when the RM made no progress)."""
    if rm_beside <= 0:
        return math.inf
    return max(0.0, 1 - decode_beside / decode_alone) / (rm_beside / rm_alone)


def beside_a_thread(policy: Any, rm: Any, batch: int, device: torch.device) -> dict[str, Any]:
    """Decode in one stream while a thread loops RM forwards in another; figures alone and side by side."""
    decode_stream, rm_stream = _new_stream(device), _new_stream(device)
    ids = _ids(rm, RM_ROWS, RM_WIDTH, device, seed=7)
    decode_run(policy, batch, device, decode_stream, steps=8)  # warm-up
    alone = decode_run(policy, batch, device, decode_stream)
    rm_alone = rm_alone_tok_s(rm, ids, rm_stream)
    stop, first, spans = threading.Event(), threading.Event(), []

    def loop() -> None:
        try:
            while not stop.is_set():
                start = time.monotonic()
                rm_forward(rm, ids, rm_stream)
                spans.append((start, time.monotonic()))
                first.set()  # the decode's window opens with the RM already running
        finally:
            first.set()  # an error: the decode goes on and future.result() raises it

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(loop)
        first.wait(600)
        try:
            beside = decode_run(policy, batch, device, decode_stream)
        finally:
            stop.set()
        future.result(600)  # re-raises the RM thread's error, if any
    return _figures("stream", batch, alone, beside, rm_alone, spans, ids.numel())


_CHILD = """
import json, sys, threading, time, torch
from verl_async_rm.bench.rm_model import build_random_rm
shape, rows, width, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model, _ = build_random_rm(shape, None, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
top = min(int(model.config.vocab_size), 32000)
ids = torch.randint(3, top, (rows, width), generator=torch.Generator().manual_seed(7)).to(device)
def forward():
    with torch.inference_mode():
        model(input_ids=ids).logits.float().cpu()
forward()
best = float("inf")
for _ in range(reps):
    t = time.monotonic()
    forward()
    best = min(best, time.monotonic() - t)
print("ready", flush=True)
spans = []
while not stop.is_set():
    t = time.monotonic()
    forward()
    spans.append((t, time.monotonic()))
print(json.dumps({"alone_tok_s": rows * width / best, "spans": spans, "tokens": rows * width}), flush=True)
"""


def beside_a_process(policy: Any, batch: int, device: torch.device, shape: str = SHAPE) -> dict[str, Any]:
    """Decode here while another process (its own CUDA context) loops RM forwards of ``shape``."""
    stream = _new_stream(device)
    decode_run(policy, batch, device, stream, steps=8)  # warm-up
    alone = decode_run(policy, batch, device, stream)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: its warnings can never fill a pipe and block it
        child = subprocess.Popen([sys.executable, "-c", _CHILD, shape, str(RM_ROWS), str(RM_WIDTH), str(RM_REPS)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            ready = child.stdout.readline()
            if ready.strip() == "ready":
                try:
                    beside = decode_run(policy, batch, device, stream)
                finally:
                    child.stdin.write("stop\n")
                    child.stdin.flush()
                out = child.communicate(timeout=600)[0]
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(60)
        if ready.strip() != "ready" or child.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"the RM process failed (exit {child.returncode}, first line {ready!r}):\n"
                               f"{err.read()[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return _figures("process", batch, alone, beside, result["alone_tok_s"], [tuple(s) for s in result["spans"]],
                    result["tokens"])


def _figures(kind: str, batch: int, alone: dict[str, float], beside: dict[str, float], rm_alone: float,
             spans: list[tuple[float, float]], tokens: int) -> dict[str, Any]:
    rm_beside = tokens_in_window(spans, tokens, beside["start"], beside["end"]) / (beside["end"] - beside["start"])
    return {
        "rm_beside": kind, "decode_batch": batch,
        "decode_alone_tok_s": alone["tok_s"], "decode_beside_tok_s": beside["tok_s"],
        "rm_alone_tok_s": rm_alone, "rm_beside_tok_s": rm_beside,
        "decode_slowdown": 1 - beside["tok_s"] / alone["tok_s"], "rm_slowdown": 1 - rm_beside / rm_alone,
        "share_slowdown": share_slowdown(alone["tok_s"], beside["tok_s"], rm_alone, rm_beside),
        "decode_window_s": beside["end"] - beside["start"], "rm_forwards_in_window": sum(
            1 for a, b in spans if b > beside["start"] and a < beside["end"]),
    }


def sleep_and_wake(model: Any, device: torch.device) -> dict[str, Any]:
    """The plugin's own sleep and wake (:class:`~verl_async_rm.scoring.offload.WeightOffload`, what an RM replica on
    the policy's GPUs does), two cycles: the first sleep pins its host buffers, the second reuses them (every step's
    cost). Seconds and GB/s each way, the device memory a sleep frees, the weights checked unchanged."""
    from verl_async_rm.scoring.offload import WeightOffload

    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type == device.type]
    probe = tensors[0].detach().flatten()[:4096].clone()
    offload = WeightOffload(model, device)
    _sync(device)
    held = torch.cuda.memory_allocated(device)
    first = offload.sleep()
    freed = held - torch.cuda.memory_allocated(device)
    offload.wake()
    slept = offload.sleep()
    woke = offload.wake()
    intact = bool(torch.equal(tensors[0].detach().flatten()[:4096], probe))
    return {"pinned": True, "bytes": slept.bytes, "freed_bytes": freed, "first_sleep_s": first.seconds,
            "sleep_s": slept.seconds, "wake_s": woke.seconds, "sleep_gbps": slept.bytes / slept.seconds / 1e9,
            "wake_gbps": woke.bytes / woke.seconds / 1e9, "weights_intact": intact}


def naive_to_and_back(model: Any, device: torch.device) -> dict[str, Any]:
    """``model.to('cpu')`` and ``model.to(device)``: the pageable-memory path a plain offload takes."""
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    _sync(device)
    start = time.monotonic()
    model.to("cpu")
    sleep_s = time.monotonic() - start
    start = time.monotonic()
    model.to(device)
    _sync(device)
    wake_s = time.monotonic() - start
    return {"bytes": size, "sleep_s": sleep_s, "wake_s": wake_s, "sleep_gbps": size / sleep_s / 1e9,
            "wake_gbps": size / wake_s / 1e9}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def record(tmp_path_factory, device):
    """The figures of this module's tests, written to ``colocation_gpu.json`` at the end with the flags they give
    ``bench layout``."""
    figures: dict[str, Any] = {"device_name": torch.cuda.get_device_name(device), "torch": torch.__version__,
                               "shape": SHAPE, "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                               "beside": [], "sleep_wake": {}}
    yield figures
    figures["bench_layout_flags"] = _flags(figures)
    figures["bench_layout_flags_note"] = ("--host-gbps is one GPU copying alone: lower it for 8 GPUs copying at once "
                                          "through shared PCIe switches; the process runs give the slowdown without "
                                          "MPS (time-slicing)")
    out = Path(os.environ.get("VERL_ASYNC_RM_GPU_OUT") or tmp_path_factory.mktemp("colocation"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "colocation_gpu.json"
    path.write_text(json.dumps(figures, indent=1, default=str) + "\n", encoding="utf-8")
    logger.info("colocation figures (%s): %s", path, json.dumps(figures, default=str))
    print(f"\ncolocation figures written to {path}\nbench layout flags: {figures['bench_layout_flags']}")


def _flags(figures: dict[str, Any]) -> str:
    """``bench layout`` flags from the figures: slowdowns of the stream runs (capped at 1), pinned GB/s, RM size."""
    flags = []
    for name, batch in DECODE_BATCHES.items():
        found = [f for f in figures["beside"] if f["rm_beside"] == "stream" and f["decode_batch"] == batch]
        if found:
            flag = "--share-slowdown-tail" if name == "tail" else "--share-slowdown"
            flags.append(f"{flag} {min(1.0, found[0]['share_slowdown']):.2f}")
    pinned = figures["sleep_wake"].get("pinned")
    if pinned:
        gbps = min(pinned["sleep_gbps"], pinned["wake_gbps"])
        flags += [f"--host-gbps {gbps:.1f}", f"--rm-weight-gb {pinned['bytes'] / 1e9:.2f}"]
    return " ".join(flags)


@pytest.fixture(scope="module")
def policy(device):
    model = build_causal_lm(SHAPE, device, torch.bfloat16)
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def rm(device):
    model, _ = build_random_rm(SHAPE, None, device, torch.bfloat16)
    yield model
    del model
    torch.cuda.empty_cache()


def test_rm_sleep_and_wake_through_host_memory(rm, device, record):
    figures = sleep_and_wake(rm, device)
    record["sleep_wake"]["pinned"] = figures
    logger.info("8B RM sleep and wake (the plugin's WeightOffload): %s", figures)
    assert figures["weights_intact"]
    assert figures["bytes"] > 14e9  # the 8B shape: 7.5e9 bf16 parameters
    assert figures["freed_bytes"] >= 0.95 * figures["bytes"]  # the device's copy is really released
    for key in ("first_sleep_s", "sleep_s", "wake_s", "sleep_gbps", "wake_gbps"):
        assert _positive(figures[key]), (key, figures)


def test_rm_naive_offload_to_cpu_and_back(rm, device, record):
    figures = naive_to_and_back(rm, device)
    record["sleep_wake"]["model_to"] = figures
    logger.info("8B RM model.to('cpu') and back: %s", figures)
    assert next(rm.parameters()).device.type == "cuda"
    for key in ("sleep_s", "wake_s", "sleep_gbps", "wake_gbps"):
        assert _positive(figures[key]), (key, figures)


@pytest.mark.parametrize("batch", sorted(DECODE_BATCHES.values()))
def test_decode_beside_rm_forwards_in_another_stream(policy, rm, device, record, batch):
    figures = beside_a_thread(policy, rm, batch, device)
    figures["decode_gpu_busy_share"] = busy = gpu_busy_share(policy, batch, device)
    figures["launch_bound"] = None if busy is None else busy < 0.8
    record["beside"].append(figures)
    logger.info("decode beside an RM stream, batch %d: %s", batch, figures)
    for key in ("decode_alone_tok_s", "decode_beside_tok_s", "rm_alone_tok_s", "rm_beside_tok_s", "decode_window_s"):
        assert _positive(figures[key]), (key, figures)
    assert figures["rm_forwards_in_window"] >= 1 and figures["share_slowdown"] >= 0


@pytest.mark.parametrize("batch", sorted(DECODE_BATCHES.values()))
def test_decode_beside_rm_forwards_in_another_process(policy, device, record, batch):
    figures = beside_a_process(policy, batch, device)
    record["beside"].append(figures)
    logger.info("decode beside an RM process, batch %d: %s", batch, figures)
    for key in ("decode_alone_tok_s", "decode_beside_tok_s", "rm_alone_tok_s", "rm_beside_tok_s", "decode_window_s"):
        assert _positive(figures[key]), (key, figures)
    assert figures["rm_forwards_in_window"] >= 1 and figures["share_slowdown"] >= 0
