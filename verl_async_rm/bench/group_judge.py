"""``verl-async-rm bench group-judge``: a group judge against a per-response judge that writes its verdict, on the same
trajectories and the same judge model, through the RM service's own parts in one process (no Ray): the
:class:`~verl_async_rm.service.group_gate.GroupGate` (group judge only), the
:class:`~verl_async_rm.service.batcher.Batcher` and a replica's :class:`~verl_async_rm.scoring.scorer.RewardModelScorer`
with its vLLM engine.

The trajectories have the demo's sizes: ``--steps`` steps of ``--prompts`` word problems (the demo's) x
``--rollout-n`` responses of 8 to ``--max-response`` policy tokens (random ids of the tiny policy's vocabulary: the
token counts are real, the text is not). Each trajectory reaches the RM when its rollout would end (seeded: ``0.2 s +
tokens x --token-ms`` with log-normal jitter), as the agent-loop workers send them; a step starts when the previous
one's last score is back (verl's sync trainer).

The judge is the tiny ``json`` judge (``verl_async_rm.testing.judges``): the group judge's reply is constrained to a
number per label (vLLM's structured output); the per-response judge writes free text, read by ``judge_pattern``, at
most ``--verdict-tokens`` tokens (the size of a bare ``Verdict: 7``; a judge that explains itself writes more). Both
use their default prompts. Reported per mode: judge calls and tokens in and out per trajectory, and each
trajectory's reward wait (from reaching the RM to its score, p50/p99, which for a group judge includes the wait for its
group's last member) and each step's reward tail (from its last trajectory reaching the RM to its last score)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_group_judge_bench", "format_table"]

MODES = ("per_response", "group")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-async-rm bench group-judge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps (default: 3)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (default: 8, the demo's)")
    parser.add_argument("--rollout-n", type=int, default=4, help="responses per prompt (default: 4, the demo's)")
    parser.add_argument("--max-response", type=int, default=32, help="longest response in policy tokens (default: "
                        "32, the demo's)")
    parser.add_argument("--token-ms", type=float, default=30.0, help="rollout time per response token (default: 30)")
    parser.add_argument("--verdict-tokens", type=int, default=4, help="judge_max_tokens of the per-response judge "
                        "(default: 4)")
    parser.add_argument("--group-max-tokens", type=int, default=64, help="judge_max_tokens of the group judge "
                        "(default: 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=None, help="where the tiny models are built (default: "
                        "$VERL_ASYNC_RM_CACHE or ~/.cache/verl_async_rm)")
    parser.add_argument("--out", default=None, help="directory for bench_group_judge.json")
    return parser


def _steps(args: argparse.Namespace, policy_tok: Any) -> list[list[tuple[float, Any]]]:
    """Per step, ``(seconds after the step's start, request)`` of every trajectory, in arrival order."""
    from verl_async_rm.demo.data import word_problems
    from verl_async_rm.request import RMRequest

    rng = random.Random(args.seed)
    problems = word_problems(args.steps * args.prompts, args.seed)
    low = 5  # the tiny tokenizer's special tokens come first
    steps = []
    for s in range(args.steps):
        arrivals = []
        for p in range(args.prompts):
            question, answer = problems[s * args.prompts + p]
            messages = [{"role": "user", "content": question}]
            prompt_ids = policy_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
            for j in range(args.rollout_n):
                length = rng.randint(8, args.max_response)
                ids = [rng.randrange(low, len(policy_tok)) for _ in range(length)] + [policy_tok.eos_token_id]
                finish = 0.2 + length * args.token_ms / 1000.0 * math.exp(rng.gauss(0.0, 0.15))
                arrivals.append((finish, RMRequest(
                    uid=f"s{s}p{p}/{j}", prompt_ids=prompt_ids, response_ids=ids, raw_prompt=messages,
                    group=f"s{s}p{p}", group_size=args.rollout_n, ground_truth=answer)))
        steps.append(sorted(arrivals, key=lambda a: a[0]))
    return steps


async def _run_mode(scorer: Any, steps: list[list[tuple[float, Any]]], group: bool) -> dict[str, Any]:
    """Every step's trajectories through the service's parts; each one's wait and each step's tail."""
    from verl_async_rm.service.batcher import Batcher
    from verl_async_rm.service.batching import BatchPolicy
    from verl_async_rm.service.group_gate import GroupGate

    async def replica(items: list[Any], _replica: Any, deadline: float) -> list[Any]:
        return await asyncio.to_thread(scorer.score, items)

    batcher = Batcher(replica, BatchPolicy(max_batch_size=32, max_wait_ms=20), name="bench")

    async def judge(request: Any, deadline_s: float | None) -> Any:
        return await batcher.submit(request, num_tokens=request.num_tokens)

    gate = GroupGate(judge, wait_s=60.0) if group else None
    loop = asyncio.get_running_loop()
    waits: list[float] = []
    tails: list[float] = []
    failed = 0

    async def one(start: float, offset: float, request: Any) -> float:
        await asyncio.sleep(max(0.0, start + offset - loop.time()))
        arrived = loop.time()
        result = await (gate.submit(request) if gate is not None else judge(request, None))
        nonlocal failed
        failed += isinstance(result, BaseException)
        waits.append(loop.time() - arrived)
        return arrived

    scorer.pop_step_stats()
    for arrivals in steps:
        start = loop.time()
        arrived = await asyncio.gather(*(one(start, offset, request) for offset, request in arrivals))
        tails.append(loop.time() - max(arrived))
    await batcher.aclose()
    stats = scorer.pop_step_stats()
    trajectories = sum(len(a) for a in steps)
    ordered = sorted(waits)
    return {
        "trajectories": trajectories, "judge_calls": stats.requests,
        "judge_calls_per_trajectory": stats.requests / trajectories,
        "judge_tokens_in_per_trajectory": stats.tokens / trajectories,
        "judge_tokens_out_per_trajectory": (stats.judge_tokens or 0) / trajectories,
        "parse_failures": stats.judge_parse_failures, "failed": failed,
        "reward_wait_s_p50": ordered[math.ceil(0.5 * len(ordered)) - 1],
        "reward_wait_s_p99": ordered[math.ceil(0.99 * len(ordered)) - 1],
        "step_tail_s_mean": sum(tails) / len(tails), "step_tail_s_max": max(tails)}


def run_group_judge_bench(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    from verl_async_rm.bench.environment import environment_snapshot
    from verl_async_rm.scoring.rm_config import RMConfig
    from verl_async_rm.scoring.scorer import RewardModelScorer
    from verl_async_rm.testing.judges import build_tiny_judges
    from verl_async_rm.testing.models import build_tiny_models

    tiny, judges = build_tiny_models(args.cache), build_tiny_judges(args.cache)
    steps = _steps(args, AutoTokenizer.from_pretrained(tiny.policy))
    base = {"model_path": str(judges.json), "policy_tokenizer_path": str(tiny.policy), "use_gpu": False}
    configs = {
        "per_response": RMConfig(**base, reward_kind="judge", judge_readout="generate", judge_pattern="([0-9])",
                                 judge_max_tokens=args.verdict_tokens),
        "group": RMConfig(**base, reward_kind="group_judge", judge_max_tokens=args.group_max_tokens, judge_scale=10)}
    modes = {}
    for mode in MODES:
        scorer = RewardModelScorer(configs[mode])
        try:
            asyncio.run(_run_mode(scorer, steps[:1], mode == "group"))  # warm-up: the engine's first calls
            started = time.perf_counter()
            modes[mode] = asyncio.run(_run_mode(scorer, steps, mode == "group"))
            modes[mode]["seconds"] = time.perf_counter() - started
        finally:
            scorer.engine.close()
    return {"bench": "group_judge", "steps": args.steps, "prompts": args.prompts, "rollout_n": args.rollout_n,
            "max_response": args.max_response, "token_ms": args.token_ms, "verdict_tokens": args.verdict_tokens,
            "group_max_tokens": args.group_max_tokens, "seed": args.seed, "modes": modes,
            "environment": environment_snapshot()}


def format_table(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"group judge bench: {report['steps']} steps x {report['prompts']} prompts x {report['rollout_n']} "
             f"responses (<= {report['max_response']} tokens), {env['cpus']} CPUs, load {env['load_avg_1min']}",
             "| mode | judge calls / trajectory | judge tokens in / trajectory | judge tokens out / trajectory | "
             "reward wait p50 / p99 s | step tail mean / max s | failed (parse) |",
             "|---|---|---|---|---|---|---|"]
    for name, row in report["modes"].items():
        lines.append(f"| {name} | {row['judge_calls_per_trajectory']:.3f} | "
                     f"{row['judge_tokens_in_per_trajectory']:.1f} "
                     f"| {row['judge_tokens_out_per_trajectory']:.2f} | {row['reward_wait_s_p50']:.3f} / "
                     f"{row['reward_wait_s_p99']:.3f} | {row['step_tail_s_mean']:.3f} / {row['step_tail_s_max']:.3f} "
                     f"| {row['failed']} ({row['parse_failures']}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> tuple[int, str]:
    args = build_parser().parse_args(argv)
    report = run_group_judge_bench(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_group_judge.json").write_text(json.dumps(report, indent=2))
    return 0, format_table(report)
