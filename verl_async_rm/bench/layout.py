"""``verl-async-rm bench layout``: which RM placement gives the shorter RL step, modelled on paper (no GPU, no clock).

One RL step on ``N = nodes x gpus_per_node`` GPUs is a rollout, the RM scores and the policy update. Four layouts:

- ``no-rm`` (reference): no RM at all (a rule reward): the rollout and the update on all ``N`` GPUs;
- ``dedicated:k``: an RM pool of ``k`` GPUs (this plugin's design). The policy rolls out and updates on ``N - k``
  GPUs; the RM scores each trajectory as it finishes, on GPUs of its own, so only a tail remains after the last
  trajectory; the RM GPUs idle during the update;
- ``overlapped``: an RM replica on every one of the ``N`` GPUs, awake during the rollout; each finished trajectory's
  RM prefill runs beside the sequences still decoding there; asleep (weights to host memory) during the update, so
  every step pays a wake and a sleep;
- ``colocated-after``: verl's colocated RM: after the rollout the RM wakes, scores the whole batch on all ``N`` GPUs
  and sleeps again; no overlap.

The workload: ``B`` trajectories with prompt ``p_i`` and response ``r_i`` tokens, drawn by the overlap benchmark's
generator (:func:`~verl_async_rm.bench.workload.generate_workload`: log-normal lengths, clipped; its finish times
are not used, this model computes its own).

**Rollout on G policy GPUs.** The prompts are prefilled first: ``t_pre = sum(p_i) / (G * P)``. Then every sequence
still decoding advances at one common speed (sequences spread evenly over the GPUs, as continuous batching fills
every replica). With ``A`` sequences active, ``a = A / G`` per GPU, decode is memory-bandwidth bound and its
throughput grows with the batch up to a saturation batch ``S``::

    u(a) = min(1, a / S)                   the GPU's decode utilisation (the long tail's under-use, explicit)
    per-GPU decode tokens/s = T * u(a)      =>   per-sequence speed v(A) = min(T * G / A, T / S)

so a lone sequence decodes at ``T / S`` tokens/s however many GPUs are free: the last, longest trajectories set the
rollout's length and fewer GPUs only slow its crowded first part. Trajectory ``i`` finishes when the per-sequence
progress reaches ``r_i`` (shortest first). The calculation is exact for this fluid model: it steps from one event
(a trajectory finishes, the RM queue empties) to the next, with every rate constant in between.

**RM.** Trajectory ``i`` costs ``w_i = (p_i + r_i) / R`` seconds of one GPU (``R``: RM prefill tokens/s per GPU,
packed: real tokens only). As it finishes its work joins a queue spread evenly over the layout's RM GPUs (backlog
``q``, seconds per GPU) that drains at full speed. A call also has a fixed latency ``c`` (launch, copies,
synchronisation): paid once in the tail, not GPU work. After the last finish::

    tail = c + max(q_end, w_last)                (q_end: the backlog left; w_last: the last trajectory alone)
    colocated-after scoring time = c + max(sum(w_i) / N, max(w_i))

**Sharing a GPU (overlapped only; the assumption this model rests on).** While the RM queue is not empty, the RM
prefill runs at full speed on every GPU and the decode beside it slows by a factor ``s``::

    v -> v * (1 - s(u)),   s(u) = s_tail + (s_sat - s_tail) * u(a)

``s_sat`` (``--share-slowdown``) is what a saturated decode loses while a prefill runs beside it: the fraction of the
RM's time taken from decoding. ``s = 1``: the two time-slice the GPU (two processes without MPS: the RM's work costs
the decode its full duration); ``s = 0``: the prefill fits in capacity the memory-bound decode leaves unused.
``s_tail`` (``--share-slowdown-tail``, default ``s_sat``) is the same for a decode of a few sequences (``u -> 0``):
below ``s_sat`` when the RM uses the tail's idle capacity better. GPUs with no sequence left run the RM beside
nothing. ``tests/gpu/test_colocation_gpu.py`` measures ``s`` as ``(1 - D1/D0) / (R1/R0)`` (decode tokens/s ``D``
and RM tokens/s ``R``, alone ``0`` and side by side ``1``).

**Sleep, wake, update.** Each of sleep and wake moves the RM's weights between device and host: ``W / H`` seconds
(``W`` bytes per GPU, ``H`` host<->device bytes/s per GPU with all GPUs copying at once), on the step's critical
path (conservative: a wake could overlap the rollout's first seconds). The update takes ``U`` on ``N`` GPUs and
``U * N / G`` on ``G``. Step times::

    no-rm            t_roll(N) + U
    dedicated:k      t_roll(N - k; RM queue on k GPUs) + tail + U * N / (N - k)
    overlapped       W/H + t_roll(N; RM shared on N GPUs) + tail + W/H + U
    colocated-after  t_roll(N) + W/H + (c + max(sum(w) / N, max(w))) + W/H + U

Every layout holds the ``N`` GPUs for the whole step: ``GPU-s = N * step``. ``idle GPU-s``: GPU-seconds with no
kernel on the GPU (no sequence, no RM work, no update), the sleep and wake copies and the RM's fixed call latency
included. ``decode util``: the time-mean of ``u`` over the policy GPUs while decoding (``1 - util``: the capacity
the long tail leaves unused, ``decode_unused_gpu_s`` in the JSON).

Not modelled: KV-cache memory the awake RM takes from the rollout (``W`` per GPU), uneven placement of sequences on
replicas, decode slowing as contexts grow, multi-turn tool calls, and the RM slowing beside the decode
(the GPU test reports it). Output: a markdown table and, with ``--out``, ``bench_layout.json`` (every input, where it
comes from, every assumption, every layout's figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_async_rm.bench.rm_model import SHAPES
from verl_async_rm.bench.workload import Workload, WorkloadConfig, generate_workload
from verl_async_rm.testing.generation import LengthDistribution

__all__ = ["ASSUMPTIONS", "DEFAULT_PRESET", "PRESETS", "LayoutInputs", "LayoutResult", "Rollout", "build_parser",
           "compare_layouts", "dense_parameters", "format_table", "main", "resolve_inputs", "run_layout_bench",
           "sensitivity", "simulate_rollout"]

#: Share slowdowns printed in the sensitivity line (a constant ``s``: ``s_sat = s_tail``).
SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class LayoutInputs:
    """Every input of the model (see the module docstring for the symbols). Errors name the command-line flag."""

    nodes: int = field(metadata=_help("nodes in the cluster"))
    gpus_per_node: int = field(metadata=_help("GPUs per node; N = nodes x gpus-per-node"))
    dedicated: tuple[int, ...] = field(metadata=_help("comma-separated sizes k of the dedicated RM pool to compare, "
                                                      "each in 1..N-1 ('' for none)"))
    trajectories: int = field(metadata=_help("trajectories per step, B (train_batch_size x rollout.n)"))
    prompt_median: float = field(metadata=_help("median prompt length, tokens (log-normal)"))
    prompt_sigma: float = field(metadata=_help("sigma of the log-normal prompt length"))
    prompt_max: int = field(metadata=_help("longest prompt, tokens (the clip)"))
    response_median: float = field(metadata=_help("median response length, tokens (log-normal)"))
    response_sigma: float = field(metadata=_help("sigma of the log-normal response length (about 1: RL's long tail)"))
    response_max: int = field(metadata=_help("longest response, tokens (rollout.response_length)"))
    seed: int = field(metadata=_help("seed of the length draws"))
    policy_prefill_tok_s: float = field(metadata=_help("policy prompt prefill tokens/s per GPU, P"))
    decode_tok_s: float = field(metadata=_help("policy decode tokens/s per GPU at saturation, T"))
    saturation_batch: float = field(metadata=_help("sequences per GPU at which decode saturates, S (a lone sequence "
                                                   "decodes at T/S tokens/s)"))
    update_s: float = field(metadata=_help("policy update seconds per step on all N GPUs, U (scales as 1/GPUs)"))
    rm_tok_s: float = field(metadata=_help("RM prefill tokens/s per GPU, R (`verl-async-rm bench rm` on your device: "
                                           "fresh_tok_per_s; inf: a free RM)"))
    rm_call_ms: float = field(metadata=_help("RM fixed latency per call, ms, c"))
    rm_weight_gb: float = field(metadata=_help("RM weights per GPU, GB (1e9 bytes), W: moved at each sleep and wake"))
    host_gbps: float = field(metadata=_help("host<->device GB/s per GPU with every GPU copying, H"))
    share_slowdown: float = field(metadata=_help("s_sat in [0, 1]: fraction of the RM's time taken from a saturated "
                                                 "decode beside it (1: time-slicing, 0: free)"))
    share_slowdown_tail: float | None = field(default=None, metadata=_help(
        "s_tail in [0, 1]: the same for a decode of few sequences (default: --share-slowdown)"))

    def __post_init__(self) -> None:
        if self.share_slowdown_tail is None:
            object.__setattr__(self, "share_slowdown_tail", self.share_slowdown)
        for name in ("nodes", "gpus_per_node", "trajectories", "prompt_max", "response_max"):
            _check_int(name, getattr(self, name), 1)
        _check_int("seed", self.seed, None)
        for name in ("prompt_median", "response_median", "policy_prefill_tok_s", "decode_tok_s", "saturation_batch"):
            _check_number(name, getattr(self, name), positive=True)
        for name in ("prompt_sigma", "response_sigma", "update_s", "rm_call_ms", "rm_weight_gb"):
            _check_number(name, getattr(self, name), positive=False)
        for name in ("rm_tok_s", "host_gbps"):
            _check_number(name, getattr(self, name), positive=True, infinite=True)
        for name in ("share_slowdown", "share_slowdown_tail"):
            value = getattr(self, name)
            _check_number(name, value, positive=False)
            if value > 1:
                raise ValueError(f"{_flag(name)} {value!r}: a slowdown is a fraction of the decode's speed, in "
                                 f"[0, 1]. Fix: 1 for time-slicing, 0 for a free RM, or the GPU test's figure")
        self._check_dedicated()

    def _check_dedicated(self) -> None:
        n = self.gpus
        if not isinstance(self.dedicated, tuple):
            raise TypeError(f"--dedicated {self.dedicated!r}: expected a tuple of pool sizes. Fix: e.g. (1, 2), or "
                            f"--dedicated 1,2 on the command line")
        for k in self.dedicated:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < n:
                fix = f"--dedicated {max(1, n // 4)}" if n > 1 else "--dedicated '' (no pool on one GPU)"
                raise ValueError(f"--dedicated {k!r}: a dedicated RM pool needs 1 <= k < N GPUs, and N = --nodes "
                                 f"{self.nodes} x --gpus-per-node {self.gpus_per_node} = {n}, leaving the policy "
                                 f"at least one. Fix: {fix}, or more GPUs")

    @property
    def gpus(self) -> int:
        """N: every GPU of the cluster."""
        return self.nodes * self.gpus_per_node

    def share_slowdown_at(self, utilisation: float) -> float:
        """``s(u) = s_tail + (s_sat - s_tail) * u``: the decode's slowdown beside an RM prefill at utilisation u."""
        return self.share_slowdown_tail + (self.share_slowdown - self.share_slowdown_tail) * utilisation

    def workload_config(self) -> WorkloadConfig:
        """The overlap benchmark's workload with these lengths (its finish-time fields are not used here)."""
        return WorkloadConfig(
            trajectories=self.trajectories, seed=self.seed,
            prompt_lengths=LengthDistribution(median_tokens=self.prompt_median, sigma=self.prompt_sigma,
                                              min_tokens=min(16, self.prompt_max), max_tokens=self.prompt_max),
            response_lengths=LengthDistribution(median_tokens=self.response_median, sigma=self.response_sigma,
                                                min_tokens=1, max_tokens=self.response_max),
        )


def _check_int(name: str, value: Any, low: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise ValueError(f"{_flag(name)} {value!r}: must be an integer{'' if low is None else f' >= {low}'}. "
                         f"Fix: give a whole number, e.g. {_flag(name)} {max(low or 0, 1)}")


def _check_number(name: str, value: Any, *, positive: bool, infinite: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
    ok = ok and (value > 0 if positive else value >= 0) and (infinite or math.isfinite(value))
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{_flag(name)} {value!r}: must be a {'' if infinite else 'finite '}number {bound}. "
                         f"Fix: measure it or take the preset's ({_flag(name)} {PRESETS[DEFAULT_PRESET][name][0]})")


def dense_parameters(shape: dict[str, Any], num_labels: int = 1) -> int:
    """Parameters of a dense Llama/Qwen2 sequence-classification model of ``shape`` (a ``config.json``'s fields):
    embeddings, layers (attention with grouped KV heads, Qwen2's q/k/v biases, SwiGLU MLP, two norms), final norm and
    a ``num_labels`` score head. Llama-3.1-8B: 7,504,928,768 (transformers counts the same)."""
    if shape.get("model_type") not in ("llama", "qwen2"):
        raise ValueError(f"dense_parameters: model_type {shape.get('model_type')!r} is not a dense llama/qwen2 shape. "
                         f"Fix: pass the weights' size with --rm-weight-gb")
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden + ((q + 2 * kv) if shape["model_type"] == "qwen2" else 0)
    layer = attention + 3 * hidden * shape["intermediate_size"] + 2 * hidden
    return shape["vocab_size"] * hidden + layers * layer + hidden + hidden * num_labels


DEFAULT_PRESET = "h100-8gpu-7b-policy-8b-rm"
_WORKLOAD = "assumed: the overlap benchmark's default workload"
_RM_GB = round(dense_parameters(SHAPES["llama8b"]) * 2 / 1e9, 2)

#: Presets: field -> (value, where it comes from). Every source says "measured", "computed" or "assumed".
PRESETS: dict[str, dict[str, tuple[Any, str]]] = {
    DEFAULT_PRESET: {
        "nodes": (1, "assumed: one node"),
        "gpus_per_node": (8, "assumed: 8 x H100 80GB"),
        "dedicated": ((1, 2), "assumed: the plugin's recipes split 6 + 2"),
        "trajectories": (1024, "assumed: 128 prompts x rollout.n 8"),
        "prompt_median": (256, _WORKLOAD), "prompt_sigma": (0.5, _WORKLOAD), "prompt_max": (2048, _WORKLOAD),
        "response_median": (512, _WORKLOAD), "response_sigma": (1.0, _WORKLOAD), "response_max": (4096, _WORKLOAD),
        "seed": (0, _WORKLOAD),
        "policy_prefill_tok_s": (30000, "assumed: a 7B policy prefills about as fast as the 8B RM scorer (rm_tok_s)"),
        "decode_tok_s": (12000, "assumed: vLLM, 7B bf16 on one H100, ~128 sequences of ~1k tokens, ~10 ms per step"),
        "saturation_batch": (96, "assumed: a lone sequence decodes at T/S = 125 tokens/s (8 ms per token)"),
        "update_s": (30.0, ("assumed: GRPO update of ~1.1M tokens on 7B (fwd+bwd, old log-probs) at ~35% MFU on 8 "
                            "H100s, plus weight sync")),
        "rm_tok_s": (30500, ("assumed: the package's RM scorer, Llama-3.1-8B shape, H100, bf16, steady, as the "
                             "project's design notes report it (first pass 26.9k-28.3k, packed varlen 34.3k-34.8k); "
                             "no H100 run of it is in this repository")),
        "rm_call_ms": (30.0, "assumed: bench's RMCostModel fixed cost per call"),
        "rm_weight_gb": (_RM_GB, "computed: Llama-3.1-8B seq-cls shape (SHAPES['llama8b']), 7.505e9 parameters, bf16"),
        "host_gbps": (25.0, "assumed: pinned copies over PCIe Gen5 x16 with 8 GPUs copying at once (one alone: ~50)"),
        "share_slowdown": (0.58, "measured (docs/gpu-results.md): H200, 8B shapes, decode batch 64 beside RM "
                                 "forwards in another CUDA stream; eager HF decode, so a lower bound for vLLM's"),
        "share_slowdown_tail": (0.45, "measured (docs/gpu-results.md): as share_slowdown, decode batch 4"),
    },
}


@dataclass(frozen=True)
class Rollout:
    """One simulated rollout (seconds from the step's start; GPU-seconds over the policy and RM GPUs)."""

    prefill_s: float  #: t_pre, the prompts' prefill
    rollout_s: float  #: prefill + decode until the last trajectory finishes
    backlog_s: float  #: q_end: RM work left per RM GPU at the last finish
    last_work_s: float  #: w_last: RM work of the last trajectory to finish (the longest of a tie)
    idle_gpu_s: float  #: GPU-seconds with no kernel during the rollout
    rm_busy_s: float  #: seconds the RM queue was not empty during the rollout
    decode_slowed_s: float  #: seconds decoding ran beside the RM (shared layouts)
    decode_utilisation: float  #: time-mean of the policy GPUs' u during decode
    decode_unused_gpu_s: float  #: the decode's unused capacity, integral of G * (1 - u) over the decode


@dataclass(frozen=True)
class LayoutResult:
    """One layout's step (seconds; GPU-seconds)."""

    layout: str
    policy_gpus: int
    rm_gpus: int
    step_s: float
    rollout_s: float
    rm_tail_s: float  #: RM time after the last finish (colocated-after: all the scoring)
    sleep_wake_s: float
    update_s: float
    gpu_s: float  #: N x step_s
    idle_gpu_s: float
    rm_busy_in_rollout_s: float
    decode_slowed_s: float
    decode_utilisation: float
    decode_unused_gpu_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _per_sequence_tok_s(active: int, gpus: int, p: LayoutInputs) -> tuple[float, float]:
    """(speed of each active sequence, utilisation u of a GPU holding sequences): ``min(T*G/A, T/S)``."""
    per_gpu = max(1.0, active / gpus)  # GPUs that hold a sequence hold at least one
    utilisation = min(1.0, per_gpu / p.saturation_batch)
    return p.decode_tok_s * utilisation / per_gpu, utilisation


def simulate_rollout(workload: Workload, work_s: list[float], *, policy_gpus: int, rm_gpus: int, shared: bool,
                     inputs: LayoutInputs) -> Rollout:
    """The rollout of ``workload`` on ``policy_gpus`` GPUs, each finished trajectory's RM work ``work_s[i]`` queued
    on ``rm_gpus`` GPUs (0: no RM) that are the policy GPUs themselves when ``shared`` (see the module docstring)."""
    n, responses = workload.size, workload.response_tokens
    unique_prompts = sum(workload.prompt_tokens[i] for i in range(0, n, workload.rollout_n))
    prefill = unique_prompts / (policy_gpus * inputs.policy_prefill_tok_s)
    order = sorted(range(n), key=lambda i: (responses[i], i))
    t, progress, backlog, done = prefill, 0.0, 0.0, 0
    idle = 0.0 if shared else rm_gpus * prefill
    busy_s = slowed_s = utilisation_s = 0.0
    while done < n:
        active = n - done
        speed, utilisation = _per_sequence_tok_s(active, policy_gpus, inputs)
        busy = backlog > 0.0
        if busy and shared:
            speed *= 1.0 - inputs.share_slowdown_at(utilisation)
        target = responses[order[done]]
        to_finish = (target - progress) / speed if speed > 0 else math.inf
        dt = min(to_finish, backlog if busy else math.inf)
        empty_gpus = policy_gpus - min(policy_gpus, active)  # GPUs whose sequences have all finished
        if shared:  # a busy RM queue runs on every GPU
            idle += 0.0 if busy else dt * empty_gpus
        else:  # the RM GPUs, if any, wait for work
            idle += dt * (empty_gpus + (0 if busy else rm_gpus))
        utilisation_s += dt * min(1.0, active / (policy_gpus * inputs.saturation_batch))
        busy_s += dt if busy else 0.0
        slowed_s += dt if busy and shared else 0.0
        t += dt
        progress += speed * dt
        backlog = max(0.0, backlog - dt) if busy else 0.0
        if to_finish <= dt:
            progress = target
            while done < n and responses[order[done]] <= target:
                backlog += work_s[order[done]] / rm_gpus if rm_gpus else 0.0
                done += 1
        elif backlog < 1e-12:
            backlog = 0.0
    last = max(work_s[i] for i in range(n) if responses[i] == responses[order[-1]])
    decode_s = t - prefill
    return Rollout(prefill_s=prefill, rollout_s=t, backlog_s=backlog, last_work_s=last, idle_gpu_s=idle,
                   rm_busy_s=busy_s, decode_slowed_s=slowed_s,
                   decode_utilisation=utilisation_s / decode_s if decode_s > 0 else 0.0,
                   decode_unused_gpu_s=policy_gpus * (decode_s - utilisation_s))


def _rm_work(workload: Workload, inputs: LayoutInputs) -> list[float]:
    """``w_i = (p_i + r_i) / R``: seconds of one GPU per trajectory (0 for a free RM)."""
    return [tokens / inputs.rm_tok_s for tokens in workload.tokens]


def _sleep_s(inputs: LayoutInputs) -> float:
    """One sleep or one wake: the weights over the host link, ``W / H``."""
    return inputs.rm_weight_gb / inputs.host_gbps if inputs.rm_weight_gb else 0.0


def _tail_s(roll: Rollout, inputs: LayoutInputs) -> float:
    """``c + max(q_end, w_last)``; 0 for a free RM with no call latency."""
    if roll.backlog_s == 0 and roll.last_work_s == 0 and inputs.rm_call_ms == 0:
        return 0.0
    return inputs.rm_call_ms / 1e3 + max(roll.backlog_s, roll.last_work_s)


def _result(name: str, inputs: LayoutInputs, roll: Rollout, *, policy_gpus: int, rm_gpus: int, tail: float,
            tail_busy_gpu_s: float, sleep_wake: float, update: float, update_idle_gpus: int) -> LayoutResult:
    n = inputs.gpus
    step = roll.rollout_s + tail + sleep_wake + update
    idle = roll.idle_gpu_s + (n * tail - tail_busy_gpu_s) + n * sleep_wake + update_idle_gpus * update
    return LayoutResult(layout=name, policy_gpus=policy_gpus, rm_gpus=rm_gpus, step_s=step, rollout_s=roll.rollout_s,
                        rm_tail_s=tail, sleep_wake_s=sleep_wake, update_s=update, gpu_s=n * step, idle_gpu_s=idle,
                        rm_busy_in_rollout_s=roll.rm_busy_s, decode_slowed_s=roll.decode_slowed_s,
                        decode_utilisation=roll.decode_utilisation, decode_unused_gpu_s=roll.decode_unused_gpu_s)


def compare_layouts(inputs: LayoutInputs, workload: Workload | None = None) -> dict[str, LayoutResult]:
    """Every layout's step for ``inputs`` (``no-rm``, ``dedicated:k`` for each k, ``overlapped``,
    ``colocated-after``), on ``workload`` or the one ``inputs`` draws."""
    workload = workload or generate_workload(inputs.workload_config())
    n, work = inputs.gpus, _rm_work(workload, inputs)
    zero = [0.0] * workload.size
    alone = simulate_rollout(workload, zero, policy_gpus=n, rm_gpus=0, shared=False, inputs=inputs)
    results = {"no-rm": _result("no-rm", inputs, alone, policy_gpus=n, rm_gpus=0, tail=0.0, tail_busy_gpu_s=0.0,
                                sleep_wake=0.0, update=inputs.update_s, update_idle_gpus=0)}
    for k in inputs.dedicated:
        roll = simulate_rollout(workload, work, policy_gpus=n - k, rm_gpus=k, shared=False, inputs=inputs)
        results[f"dedicated:{k}"] = _result(
            f"dedicated:{k}", inputs, roll, policy_gpus=n - k, rm_gpus=k, tail=_tail_s(roll, inputs),
            tail_busy_gpu_s=k * roll.backlog_s, sleep_wake=0.0, update=inputs.update_s * n / (n - k),
            update_idle_gpus=k)
    sleep = _sleep_s(inputs)
    roll = simulate_rollout(workload, work, policy_gpus=n, rm_gpus=n, shared=True, inputs=inputs)
    results["overlapped"] = _result("overlapped", inputs, roll, policy_gpus=n, rm_gpus=n, tail=_tail_s(roll, inputs),
                                    tail_busy_gpu_s=n * roll.backlog_s, sleep_wake=2 * sleep, update=inputs.update_s,
                                    update_idle_gpus=0)
    total = sum(work)
    scoring = 0.0 if total == 0 and inputs.rm_call_ms == 0 else inputs.rm_call_ms / 1e3 + max(total / n, max(work))
    results["colocated-after"] = _result("colocated-after", inputs, alone, policy_gpus=n, rm_gpus=n, tail=scoring,
                                         tail_busy_gpu_s=total, sleep_wake=2 * sleep, update=inputs.update_s,
                                         update_idle_gpus=0)
    return results


def _overlapped_step(inputs: LayoutInputs, workload: Workload, s: float) -> float:
    constant = dataclasses.replace(inputs, share_slowdown=s, share_slowdown_tail=s, dedicated=())
    return compare_layouts(constant, workload)["overlapped"].step_s


def sensitivity(inputs: LayoutInputs, workload: Workload, best_other_s: float) -> dict[str, Any]:
    """``overlapped``'s step at constant share slowdowns ``SWEEP``, and the break-even ``s``: the largest constant
    slowdown at which ``overlapped`` is still no slower than ``best_other_s`` (bisection; 1.0 if it wins even at
    ``s = 1``, None if it loses even at ``s = 0``)."""
    sweep = {f"{s:g}": _overlapped_step(inputs, workload, s) for s in SWEEP}
    if _overlapped_step(inputs, workload, 0.0) > best_other_s:
        return {"overlapped_step_s_at_share_slowdown": sweep, "break_even_share_slowdown": None}
    if _overlapped_step(inputs, workload, 1.0) <= best_other_s:
        return {"overlapped_step_s_at_share_slowdown": sweep, "break_even_share_slowdown": 1.0}
    low, high = 0.0, 1.0
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if _overlapped_step(inputs, workload, mid) <= best_other_s else (low, mid)
    return {"overlapped_step_s_at_share_slowdown": sweep, "break_even_share_slowdown": low}


def build_parser() -> argparse.ArgumentParser:
    """One flag per :class:`LayoutInputs` field (its help, the preset's value and source), ``--preset``, ``--out``."""
    parser = argparse.ArgumentParser(prog="verl-async-rm bench layout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS),
                        help=f"where every input not given comes from (default: {DEFAULT_PRESET})")
    preset = PRESETS[DEFAULT_PRESET]
    for f in dataclasses.fields(LayoutInputs):
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], float)
        kind = str if f.name == "dedicated" else kind
        value, source = preset[f.name]
        shown = ",".join(map(str, value)) if f.name == "dedicated" else value
        parser.add_argument(_flag(f.name), type=kind, default=None,
                            help=f"{f.metadata['help']} (preset: {shown}; {source})".replace("%", "%%"))
    parser.add_argument("--out", default=None, help="directory for bench_layout.json")
    return parser


def _parse_dedicated(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        raise ValueError(f"--dedicated {text!r}: expected comma-separated whole numbers. Fix: e.g. --dedicated 1,2"
                         ) from None


def resolve_inputs(args: argparse.Namespace) -> tuple[LayoutInputs, dict[str, str]]:
    """The inputs (the preset's values, overridden by the flags given) and where each comes from."""
    values, sources = {}, {}
    for f in dataclasses.fields(LayoutInputs):
        given = getattr(args, f.name)
        if given is None:
            values[f.name], sources[f.name] = PRESETS[args.preset][f.name]
        else:
            values[f.name] = _parse_dedicated(given) if f.name == "dedicated" else given
            sources[f.name] = "given on the command line"
    if args.share_slowdown is not None and args.share_slowdown_tail is None:
        values["share_slowdown_tail"] = None  # follows --share-slowdown
        sources["share_slowdown_tail"] = "= --share-slowdown"
    return LayoutInputs(**values), sources


ASSUMPTIONS = {
    "decode": "decode is memory-bandwidth bound: per-GPU decode tokens/s = T * min(1, a / S) with a active sequences "
              "per GPU; every active sequence decodes at min(T * G / A, T / S); sequences spread evenly on the GPUs",
    "sharing": "overlapped: while the RM queue is not empty the RM prefill runs at full speed and the decode beside it "
               "slows by s(u) = s_tail + (s_sat - s_tail) * u; GPUs with no sequence left run the RM beside nothing",
    "rm_queue": "an RM queue spread evenly over the RM GPUs (fluid), real tokens only (packed), fixed call latency "
                "paid once in the tail; tail = c + max(q_end, w_last)",
    "colocated_after": "scoring after the rollout: c + max(sum(w) / N, max(w))",
    "sleep_wake": "each of sleep and wake copies W bytes per GPU at H bytes/s, on the critical path",
    "update": "U * N / G on G policy GPUs",
    "not_modelled": "KV-cache memory the awake RM takes from the rollout; uneven placement on replicas; decode slowing "
                    "as contexts grow; multi-turn tool calls; the RM slowing beside the decode",
}


def run_layout_bench(inputs: LayoutInputs, sources: dict[str, str], preset: str) -> dict[str, Any]:
    """The JSON-serialisable report: inputs, sources, assumptions, workload, layouts, fastest, sensitivity."""
    from verl_async_rm.bench.environment import environment_snapshot

    workload = generate_workload(inputs.workload_config())
    results = compare_layouts(inputs, workload)
    contenders = {name: r for name, r in results.items() if name != "no-rm"}
    fastest = min(contenders.values(), key=lambda r: r.step_s)
    others = [r.step_s for name, r in contenders.items() if name != "overlapped"]
    inputs_dict = {name: (value if not isinstance(value, float) or math.isfinite(value) else str(value))
                   for name, value in dataclasses.asdict(inputs).items()}  # inf as "inf": strict JSON
    inputs_dict["dedicated"] = list(inputs.dedicated)
    return {
        "benchmark": "layout",
        "kind": "modelled, not measured",
        "preset": preset,
        "gpus": inputs.gpus,
        "inputs": inputs_dict,
        "sources": sources,
        "assumptions": ASSUMPTIONS,
        "workload": workload.summary(),
        "layouts": {name: r.to_dict() for name, r in results.items()},
        "fastest": fastest.layout,
        "sensitivity": sensitivity(inputs, workload, min(others)) if others else None,
        "environment": environment_snapshot(),
    }


def format_table(report: dict[str, Any]) -> str:
    """The layouts as a markdown table, then the assumptions and the inputs with their sources."""
    i = report["inputs"]
    w = report["workload"]
    lines = [
        (f"bench layout (modelled, not measured): {i['nodes']} node(s) x {i['gpus_per_node']} GPUs = "
         f"{report['gpus']}, preset {report['preset']}; {w['trajectories']} trajectories, {w['tokens_total']:,} "
         f"tokens (median {w['tokens_p50']}, max {w['tokens_max']})"),
        "",
        ("| layout | step s | rollout s | RM tail s | sleep+wake s | update s | GPU-s per step | idle GPU-s | "
         "decode util |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["layouts"].items():
        label = f"{name} (reference)" if name == "no-rm" else name
        lines.append(f"| {label} | {r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['rm_tail_s']:.2f} | "
                     f"{r['sleep_wake_s']:.2f} | {r['update_s']:.1f} | {r['gpu_s']:.0f} | {r['idle_gpu_s']:.0f} | "
                     f"{r['decode_utilisation']:.2f} |")
    ranked = sorted((r["step_s"], name) for name, r in report["layouts"].items() if name != "no-rm")
    ranking = ", ".join(f"{name} {step:.2f} s" for step, name in ranked)
    lines += ["", f"fastest first: {ranking} (no RM: {report['layouts']['no-rm']['step_s']:.2f} s)"]
    sens = report["sensitivity"]
    if sens:
        sweep = ", ".join(f"s={s}: {v:.1f}" for s, v in sens["overlapped_step_s_at_share_slowdown"].items())
        even = sens["break_even_share_slowdown"]
        verdict = ("never (slower even at s = 0)" if even is None else
                   "at any s up to 1" if even >= 1.0 else f"while s <= {even:.3f}")
        lines += [f"overlapped step at a constant share slowdown s: {sweep}",
                  f"overlapped is no slower than the best other layout {verdict}"]
    lines += [
        "",
        (f"sharing assumption: an RM prefill beside decoding takes s(u) = s_tail + (s_sat - s_tail) * u of the "
         f"decode's speed, s_sat = {i['share_slowdown']:g}, s_tail = {i['share_slowdown_tail']:g} "
         f"({report['sources']['share_slowdown']}); the RM runs at full speed"),
        (f"tail model: per-GPU decode tokens/s = T * min(1, a / S), T = {i['decode_tok_s']:g}, "
         f"S = {i['saturation_batch']:g}: a lone sequence decodes at {i['decode_tok_s'] / i['saturation_batch']:.0f} "
         f"tokens/s"),
        "inputs:",
    ]
    lines += [f"  {_flag(name)} {i[name]}: {source}" for name, source in report["sources"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> tuple[int, str]:
    """Run from the command line; returns (exit status, the printed report)."""
    args = build_parser().parse_args(argv)
    try:
        inputs, sources = resolve_inputs(args)
        report = run_layout_bench(inputs, sources, args.preset)
    except ValueError as err:
        return 2, f"verl-async-rm bench layout: {err}"
    text = format_table(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "bench_layout.json"
        path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        text += f"\nwrote {path}"
    return 0, text
