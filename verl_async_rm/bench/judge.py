"""``verl-async-rm bench judge``: a judge RM's two readouts on the same causal LM, through the replica's scorer.

The model is a random-weight causal LM of a public shape (``bench rm``'s shapes) with the tiny ChatML tokenizer,
saved to a temporary directory; the trajectories have RL-like lengths (``rl_workload``, scaled down), GRPO groups of
``--rollout-n``. Each mode scores the same trajectories with :class:`RewardModelScorer` (judge prompt rendering
included), after a warm-up on other trajectories:

- ``logits``: one transformers forward per micro-batch, read at the next token;
- ``generate:<n>``: the replica's vLLM engine writes at most ``n`` tokens per trajectory, greedy (random weights
  rarely stop early, so this is close to the cost of an ``n``-token verdict), and the text is parsed; with
  ``--tensor-parallel 1,2`` once per ``gpus_per_replica`` (``generate:<n> tp<k>``, with the engine's start time).

Throughput does not depend on the weights' values; the verdicts of a random model mostly do not parse, which the
report counts and which does not change the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_judge_bench"]

_TOKENS = [" correct", " no"]  # single tokens of the tiny ChatML vocabulary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-async-rm bench judge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", help="a bench rm shape (default: small, 13M; vLLM on CPU needs "
                        "small or larger)")
    parser.add_argument("--requests", type=int, default=64, help="trajectories per pass (default: 64)")
    parser.add_argument("--rollout-n", type=int, default=4, help="GRPO group size (default: 4)")
    parser.add_argument("--length-scale", type=int, default=4,
                        help="divide rl_workload's lengths by this (default: 4: ~150-token inputs)")
    parser.add_argument("--max-tokens", default="32,128", help="judge_max_tokens of the generate passes")
    parser.add_argument("--tensor-parallel", default="1", help="gpus_per_replica of the generate passes, e.g. 1,2 "
                        "(on CPU: one core per rank)")
    parser.add_argument("--out", default=None, help="directory for bench_judge.json")
    return parser


def _save_model(shape: str, path: Path) -> int:
    """A random causal LM of ``shape`` and the tiny ChatML tokenizer in ``path``; returns its parameter count."""
    import torch

    from verl_async_rm.bench.rm_model import build_random_causal_lm
    from verl_async_rm.testing.models import _chatml_tokenizer

    tok = _chatml_tokenizer(0)
    model = build_random_causal_lm(shape, "cpu", torch.float32, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _requests(path: Path, n: int, seed: int, scale: int, rollout_n: int) -> list[Any]:
    from transformers import AutoTokenizer

    from verl_async_rm.bench.rm_model import rl_workload
    from verl_async_rm.request import RMRequest

    tok = AutoTokenizer.from_pretrained(path)
    rows, groups = rl_workload(n, seed, len(tok), scale, rollout_n)
    out = []
    for i, (ids, group) in enumerate(zip(rows, groups, strict=True)):
        cut = max(1, len(ids) // 4)
        question = tok.decode(ids[:cut], skip_special_tokens=True)
        out.append(RMRequest(uid=f"b{seed}-{i}", prompt_ids=ids[:cut], response_ids=ids[cut:],
                             raw_prompt=[{"role": "user", "content": question}], group=group, ground_truth="42"))
    return out


def _mode(scorer: Any, warm: list[Any], timed: list[Any], mode: str) -> dict[str, Any]:
    scorer.score(warm)
    scorer.pop_step_stats()
    start = time.perf_counter()
    results = scorer.score(timed)
    seconds = time.perf_counter() - start
    step = scorer.pop_step_stats()
    generated = step.judge_tokens
    return {
        "mode": mode,
        "seconds": seconds,
        "trajectories_per_s": len(timed) / seconds,
        "input_tokens_per_s": step.tokens / seconds,
        "generated_tokens": generated,
        "generated_tokens_per_s": None if generated is None else generated / seconds,
        "failed": sum(isinstance(r, Exception) for r in results),
        "parse_failures": step.judge_parse_failures,
    }


def run_judge_bench(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from verl_async_rm.scoring.rm_config import RMConfig
    from verl_async_rm.scoring.scorer import RewardModelScorer

    budgets = [int(n) for n in str(args.max_tokens).split(",") if n]
    parallel = [int(k) for k in str(args.tensor_parallel).split(",") if k]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_judge_") as tmp:
        path = Path(tmp)
        parameters = _save_model(args.shape, path)
        warm = _requests(path, max(8, args.rollout_n), 1, args.length_scale, args.rollout_n)
        timed = _requests(path, args.requests, 0, args.length_scale, args.rollout_n)
        base = {"model_path": str(path), "policy_tokenizer_path": str(path), "use_gpu": False,
                "reward_kind": "judge", "max_length": 4096}
        scorer = RewardModelScorer(RMConfig(**base, judge_tokens=_TOKENS))
        rows.append(_mode(scorer, warm, timed, "logits"))
        del scorer
        for budget in budgets:
            for k in parallel:
                scorer = RewardModelScorer(RMConfig(**base, judge_readout="generate", judge_max_tokens=budget,
                                                    judge_pattern="([0-9]+)", gpus_per_replica=k, n_gpus_per_node=k))
                mode = f"generate:{budget}" + (f" tp{k}" if parallel != [1] else "")
                rows.append({**_mode(scorer, warm, timed, mode), "start_s": scorer.engine.start_s})
                scorer.engine.close()
                del scorer
    return {"bench": "judge", "shape": args.shape, "parameters": parameters, "requests": args.requests,
            "rollout_n": args.rollout_n, "length_scale": args.length_scale, "host": platform.node(),
            "cpus": os.cpu_count(), "modes": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"judge bench: shape {report['shape']} ({report['parameters'] / 1e6:.1f}M parameters), "
             f"{report['requests']} trajectories, groups of {report['rollout_n']}, {report['cpus']} CPUs",
             "| mode | s per pass | trajectories/s | input tok/s | generated tok/s | failed (parse) | engine start s |",
             "|---|---|---|---|---|---|---|"]
    for row in report["modes"]:
        generated = "-" if row["generated_tokens_per_s"] is None else f"{row['generated_tokens_per_s']:,.0f}"
        parse = "" if row["parse_failures"] is None else f" ({row['parse_failures']})"
        start = f"{row['start_s']:.1f}" if "start_s" in row else "-"
        lines.append(f"| {row['mode']} | {row['seconds']:.2f} | {row['trajectories_per_s']:,.1f} | "
                     f"{row['input_tokens_per_s']:,.0f} | {generated} | {row['failed']}{parse} | {start} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> tuple[int, str]:
    args = build_parser().parse_args(argv)
    report = run_judge_bench(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_judge.json").write_text(json.dumps(report, indent=2))
    return 0, format_table(report)
