"""``verl-async-rm bench rm``: the RM scorer's forwards on this machine's device, packed and padded, against the dense
bound measured in the same run.

A random-weight RM is built on the device from a public config shape (``--shape``) or a ``config.json``
(``--config``); nothing is downloaded. A seeded RL-like workload (prompts 64-512 tokens, responses log-normal with
median ~400 up to 4096; ``tiny`` divides lengths by 16 so that a CPU run takes seconds) goes through
:meth:`verl_async_rm.scoring.transformers_engine.TransformersEngine.score_all`, the code each RM replica runs once the
inputs are tokenized, for every ``--packing`` mode:

- ``fresh``: the first pass over this workload's lengths (an RL step brings never-seen lengths every time); a warm-up
  pass over another workload comes before it, so it pays no one-off start-up costs;
- ``repeat``: the same pass again (best of 2). ``fresh / repeat`` near 1 means no per-shape stall (cuDNN plans,
  compiles).

With ``--rollout-n N`` every N inputs share a prompt (GRPO), and each packed mode also runs as ``<mode>+shared``:
the prompt once per group and micro-batch (:mod:`verl_async_rm.scoring.sharing`); compare ``fresh_traj_per_s``.

The dense bound: equal-length rows (``--budget // width`` rows of ``width`` tokens, no padding, no mask) through the
model with its own attention, best of 5: what a forward of this budget can do at best. Reported: real tokens/s, the
fraction of the bound, MFU (``2 x parameters x tokens/s / peak``, for bf16/fp16 on a known GPU, else null), the
padding fraction (of the tokens the model's layers compute; the CPU packed kernel still pads inside attention), peak
memory, and how far the modes' scores are apart. JSON (``--out``) and a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["run_rm_bench", "format_table", "main"]

MODES = ("auto", "true", "false")
ENGINES = ("transformers", "vllm")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-async-rm bench rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="llama8b, qwen0.5b, small or tiny (default: tiny; vLLM on CPU needs small or larger)")
    parser.add_argument("--config", default=None, help="a HF config.json (or its directory) instead of --shape")
    parser.add_argument("--requests", type=int, default=512, help="RM inputs per pass (default: 512)")
    parser.add_argument("--packing", default="auto,false",
                        help="comma-separated modes to run, of auto, true, false (default: auto,false)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32")
    parser.add_argument("--budget", type=int, default=None,
                        help="micro_batch_max_tokens (default: 16384; 1024 for tiny)")
    parser.add_argument("--length-scale", type=int, default=None,
                        help="divide workload lengths by this (default: 16 for tiny, else 1)")
    parser.add_argument("--rollout-n", type=int, default=1,
                        help="responses per prompt (GRPO's rollout.n); > 1 also runs packed modes with the prompt "
                             "shared once per group, as '<mode>+shared' (default: 1)")
    parser.add_argument("--sharding", default="none", choices=("none", "tensor_parallel", "fsdp2"),
                        help="run the model through a sharded replica's load path on one rank (a group of one), to "
                             "compare its cost with the unsharded model's (default: none)")
    parser.add_argument("--engine", default="transformers",
                        help="comma-separated engines, of transformers (the --packing modes) and vllm (a vLLM pooling engine, as "
                             "engine='vllm' replicas run it; with --rollout-n > 1 also 'vllm+shared': its prefix "
                             "cache on) (default: transformers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for bench_rm.json")
    return parser


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_reset(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gib(device: Any) -> tuple[float | None, str]:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda max_memory_allocated"
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process max RSS (whole run)"
    except ImportError:  # not on POSIX
        return None, "unknown"


def _timed(fn: Any, device: Any) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def dense_bound(model: Any, device: Any, budget: int, width: int, vocab: int) -> dict[str, Any]:
    """Tokens/s of ``budget // width`` equal rows of ``width`` tokens (no padding, no mask), best of 5."""
    import torch

    rows = max(1, budget // width)
    ids = torch.randint(3, min(vocab, 32000), (rows, width), generator=torch.Generator().manual_seed(1)).to(device)
    best = float("inf")
    with torch.no_grad():
        model(input_ids=ids)
        for _ in range(5):
            seconds, _ = _timed(lambda: model(input_ids=ids).logits.float().cpu(), device)
            best = min(best, seconds)
    return {"rows": rows, "width": width, "tok_per_s": rows * width / best}


def _padded_tokens(plan: list[list[int]], lengths: list[int], packed: bool) -> int:
    if packed:
        return sum(lengths[i] for batch in plan for i in batch)
    return sum(len(batch) * max(lengths[i] for i in batch) for batch in plan)


def run_mode(model: Any, device: Any, mode: str, workload: tuple[list[list[int]], list[str]],
             warmup: tuple[list[list[int]], list[str]], budget: int) -> tuple[dict[str, Any], list[float]]:
    """One mode (``auto``, ``true``, ``false``, or one of them + ``'+shared'``): a warm-up pass, then the fresh and
    the repeat pass over ``workload`` (inputs and their groups)."""
    from verl_async_rm.scoring.transformers_engine import TransformersEngine

    packing, _, shared = mode.partition("+")
    heads = (getattr(model, name, None) for name in ("score", "v_head", "classifier"))
    head = next((module for module in heads if module is not None), None)
    forward = TransformersEngine(model, head, device=device, pad_id=0, packing=packing,
                        share_prompts="true" if shared else "false")
    inputs, groups = workload
    try:
        if shared and not forward.share_prompts:
            raise ValueError(f"mode {mode}: prompts cannot be shared here ({forward.describe()['packing']})")
        _peak_memory_reset(device)
        forward.score_all(warmup[0], budget, warmup[1])
        before = forward.computed_tokens
        fresh_s, scores = _timed(lambda: forward.score_all(inputs, budget, groups), device)
        pass_tokens = forward.computed_tokens - before
        repeat_s = min(_timed(lambda: forward.score_all(inputs, budget, groups), device)[0] for _ in range(2))
        lengths = [len(ids) for ids in inputs]
        plan = forward.plan(inputs, budget, groups)
        real = sum(lengths)
        computed = pass_tokens if forward.packed else _padded_tokens(plan, lengths, packed=False)
        peak, peak_kind = _peak_memory_gib(device)
        failed = [s for s in scores if not isinstance(s, float)]
        result = {
            **forward.describe(),
            "forwards": len(plan),
            "real_tokens": real,
            "padded_tokens": computed,
            "padding_fraction": max(0.0, 1 - real / computed),
            "computed_over_real": computed / real,
            "fresh_traj_per_s": len(inputs) / fresh_s,
            "fresh_s": fresh_s,
            "repeat_s": repeat_s,
            "fresh_tok_per_s": real / fresh_s,
            "repeat_tok_per_s": real / repeat_s,
            "fresh_over_repeat": repeat_s / fresh_s,
            "peak_memory_gib": peak,
            "peak_memory_kind": peak_kind,
            "failed": len(failed),
        }
    finally:
        forward.close()
    return result, [s if isinstance(s, float) else float("nan") for s in scores]


def run_vllm_mode(model: Any, device: Any, mode: str, workload: tuple[list[list[int]], list[str]],
                  warmup: tuple[list[list[int]], list[str]], budget: int) -> tuple[dict[str, Any], list[float]]:
    """``vllm`` (prefix cache off) or ``vllm+shared`` (on): the same passes as :func:`run_mode`, on
    :class:`~verl_async_rm.scoring.vllm_engine.VLLMEngine` loaded from ``model`` saved with a word-level tokenizer.
    The prefix cache is emptied before each pass, so ``repeat`` reuses nothing of ``fresh``."""
    import tempfile

    from verl_async_rm.scoring.rm_config import RMConfig
    from verl_async_rm.scoring.vllm_engine import VLLMEngine

    path = tempfile.mkdtemp(prefix="bench_rm_vllm_")
    _save_for_vllm(model, path)
    inputs, groups = workload
    longest = max(len(ids) for ids in [*inputs, *warmup[0]])
    config = RMConfig(model_path=path, retemplate="never", micro_batch_max_tokens=budget, use_gpu=device.type != "cpu")
    shared = mode.endswith("+shared")
    forward = VLLMEngine(config, max_length=longest, dtype=model.dtype, device=device, prefix_caching=shared)

    def one_pass(rows: list[list[int]]) -> list[Any]:
        forward.llm.reset_prefix_cache()
        return forward.score_all(rows, budget)

    try:
        _peak_memory_reset(device)
        one_pass(warmup[0])
        fresh_s, scores = _timed(lambda: one_pass(inputs), device)
        repeat_s = min(_timed(lambda: one_pass(inputs), device)[0] for _ in range(2))
        real = sum(len(ids) for ids in inputs)
        peak, peak_kind = _peak_memory_gib(device)
        result = {
            **forward.describe(),
            "packing": f"vllm, prefix cache {'on' if shared else 'off'}",
            "forwards": None,
            "real_tokens": real,
            "padded_tokens": None,
            "padding_fraction": None,
            "computed_over_real": None,
            "fresh_traj_per_s": len(inputs) / fresh_s,
            "fresh_s": fresh_s,
            "repeat_s": repeat_s,
            "fresh_tok_per_s": real / fresh_s,
            "repeat_tok_per_s": real / repeat_s,
            "fresh_over_repeat": repeat_s / fresh_s,
            "engine_start_s": forward.start_s,
            "peak_memory_gib": peak,
            "peak_memory_kind": peak_kind,
            "failed": sum(not isinstance(v, float) for v in scores),
        }
    finally:
        forward.close()
    return result, [v if isinstance(v, float) else float("nan") for v in scores]


def _save_for_vllm(model: Any, path: str) -> None:
    """Save ``model`` with a word-level tokenizer of its vocabulary size (vLLM loads one; the ids are given)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(int(model.get_input_embeddings().num_embeddings))}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        pad_token="t0", bos_token="t1", eos_token="t2")
    tokenizer.save_pretrained(path)


def shard_on_one_rank(model: Any, method: str, device: Any, dtype: Any) -> Any:
    """``model`` saved and loaded again the way a sharded replica loads its RM (``scoring.sharding``), by ``method``,
    over a group of one rank: the sharded code path's own cost (DTensor or FSDP2 wrapping), with nothing to split."""
    import tempfile

    from transformers import AutoModelForSequenceClassification

    from verl_async_rm.scoring import sharding

    path = tempfile.mkdtemp(prefix="bench_rm_sharded_")
    model.save_pretrained(path)
    del model
    host, port, store = sharding.host_store(1, 300.0)
    sharding.join_group(sharding.ShardGroup(0, 1, host, port, 300.0), device, store)
    load = functools.partial(AutoModelForSequenceClassification.from_pretrained, path, dtype=dtype,
                             attn_implementation="sdpa")
    sharded, _ = sharding.load_sharded(load, path, False, device, 1, method=method)
    return sharded.eval().requires_grad_(False)


def run_rm_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark for parsed ``args`` (see :func:`build_parser`); returns the JSON-serialisable report."""
    import torch

    from verl_async_rm.bench.environment import environment_snapshot
    from verl_async_rm.bench.rm_model import build_random_rm, count_parameters, peak_flops, rl_workload
    from verl_async_rm.scoring.scorer import resolve_dtype

    modes = [m.strip() for m in args.packing.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--packing {args.packing!r}: modes are {MODES}. Fix: e.g. --packing auto,false")
    if args.requests <= 0:
        raise ValueError(f"--requests {args.requests!r}: must be positive. Fix: e.g. --requests 512")
    if args.rollout_n <= 0:
        raise ValueError(f"--rollout-n {args.rollout_n!r}: must be positive. Fix: e.g. --rollout-n 8")
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        raise ValueError(f"--engine {args.engine!r}: engines are {ENGINES}. Fix: e.g. --engine transformers,vllm")
    if "transformers" not in engines:
        modes = []
    if args.rollout_n > 1:
        modes = [m for mode in modes for m in ((mode, f"{mode}+shared") if mode != "false" else (mode,))]
    if "vllm" in engines:
        modes += ["vllm", "vllm+shared"] if args.rollout_n > 1 else ["vllm"]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = resolve_dtype(args.dtype, device.type != "cpu")
    tiny = args.config is None and args.shape == "tiny"
    scale = args.length_scale or (16 if tiny else 1)
    budget = args.budget or (16384 // 16 if tiny else 16384)

    model, name = build_random_rm(None if args.config else args.shape, args.config, device, dtype)
    if args.sharding != "none":
        model = shard_on_one_rank(model, args.sharding, device, dtype)
    vocab = int(model.get_input_embeddings().num_embeddings)
    n_params = count_parameters(model)
    workload = rl_workload(args.requests, args.seed, vocab, scale, args.rollout_n)
    warmup = rl_workload(max(8, args.requests // 4), args.seed + 1000, vocab, scale, args.rollout_n)
    bound = dense_bound(model, device, budget, width=max(8, 1024 // scale), vocab=vocab)
    peak = peak_flops(device) if dtype in (torch.bfloat16, torch.float16) else None

    def mfu(tok_per_s: float) -> float | None:
        return None if peak is None else 2 * n_params * tok_per_s / peak

    bound["mfu"] = mfu(bound["tok_per_s"])
    results: dict[str, Any] = {}
    scores: dict[str, list[float]] = {}
    try:
        for mode in modes:
            run = run_vllm_mode if mode.startswith("vllm") else run_mode
            results[mode], scores[mode] = run(model, device, mode, workload, warmup, budget)
    finally:
        if args.sharding != "none":
            from verl_async_rm.scoring.sharding import leave_group

            leave_group()
    for mode in modes:
        for key in ("fresh", "repeat"):
            tps = results[mode][f"{key}_tok_per_s"]
            results[mode][f"{key}_of_dense_bound"] = tps / bound["tok_per_s"]
            results[mode][f"{key}_mfu"] = mfu(tps)
    diffs = {
        f"{a} vs {b}": max(abs(x - y) for x, y in zip(scores[a], scores[b], strict=True))
        for i, a in enumerate(modes) for b in modes[i + 1:]
    }
    lengths = [len(ids) for ids in workload[0]]
    first = scores[modes[0]]
    mean = sum(first) / len(first)
    return {
        "benchmark": "rm",
        "environment": environment_snapshot(),
        "transformers": _version("transformers"),
        "vllm": _version("vllm") if "vllm" in engines else None,
        "shape": name,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "sharding": args.sharding,
        "n_params": n_params,
        "peak_flops": peak,
        "budget": budget,
        "workload": {"requests": len(lengths), "real_tokens": sum(lengths), "seed": args.seed,
                     "length_scale": scale, "rollout_n": args.rollout_n, "shortest": min(lengths),
                     "longest": max(lengths)},
        "dense_bound": bound,
        "modes": results,
        "scores": {"max_abs_diff": diffs, "std": (sum((s - mean) ** 2 for s in first) / len(first)) ** 0.5,
                   "first": first[:8]},
    }


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def format_table(report: dict[str, Any]) -> str:
    """The report as a few lines of text."""
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    w = report["workload"]
    b = report["dense_bound"]
    lines = [
        (f"RM bench: {report['shape']} ({report['n_params'] / 1e6:.1f}M parameters), {report['device_name']}, "
         f"{report['dtype']}, budget {report['budget']} tokens/forward"),
        (f"workload: {w['requests']} requests, {w['real_tokens']} tokens ({w['shortest']}-{w['longest']} per input, "
         f"lengths / {w['length_scale']}, rollout.n {w['rollout_n']}, seed {w['seed']})"),
        (f"dense bound ({b['rows']} x {b['width']} equal rows, no mask): {b['tok_per_s']:,.0f} tok/s, "
         f"MFU {num(b['mfu'], '.2f')}"),
        "",
        (f"{'mode':<12} {'forwards as':<33} {'fwd':>4} {'computed':>8} {'fresh tok/s':>12} {'repeat tok/s':>13} "
         f"{'fresh/rep':>9} {'traj/s':>9} {'of bound':>8} {'MFU':>5} {'peak GiB':>8}"),
    ]
    for mode, r in report["modes"].items():
        lines.append(
            f"{mode:<12} {r['packing']:<33} {num(r['forwards'], 'd'):>4} {num(r['computed_over_real'], '.3f'):>8} "
            f"{r['fresh_tok_per_s']:>12,.0f} {r['repeat_tok_per_s']:>13,.0f} {r['fresh_over_repeat']:>9.2f} "
            f"{r['fresh_traj_per_s']:>9,.1f} {r['fresh_of_dense_bound']:>8.2f} {num(r['fresh_mfu'], '.2f'):>5} "
            f"{num(r['peak_memory_gib'], '.2f'):>8}"
        )
    lines.append("computed: tokens the model's layers ran over the real tokens (padding > 1, a shared prompt < 1)")
    for pair, diff in report["scores"]["max_abs_diff"].items():
        lines.append(f"scores {pair}: max abs diff {diff:.3g} (score std {report['scores']['std']:.3g})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> tuple[int, str]:
    """Run from the command line; returns (exit status, the printed report)."""
    args = build_parser().parse_args(argv)
    try:
        report = run_rm_bench(args)
    except ValueError as err:
        return 2, f"verl-async-rm bench rm: {err}"
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_rm.json").write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    text = format_table(report)
    failed = sum(r["failed"] for r in report["modes"].values())
    if failed:
        text += f"\n{failed} input(s) failed to score: see the log"
    return (1 if failed else 0), text

