"""``verl-async-rm bench remote``: an RM served at an OpenAI-compatible endpoint, the same trajectories scored two
ways on the same server with the same limits, at each injected fault rate (a benchmark, not a test).

``--kind judge`` (default), a judge read at its first token:

- ``plugin``: :class:`~verl_async_rm.service.service.RMService` in this process (the code the RM-service actor
  runs), its replicas the endpoint's slots: one ``score`` call per trajectory, all at once, as the agent-loop workers
  send them; the endpoint client retries 429s, 5xx, dropped connections and bad bodies within each trajectory's
  deadline (``--timeout-s``).
- ``verl``: verl's ``RateLimitedRewardManager`` (``rate_limited``), built by verl's ``load_reward_manager`` from a
  config with ``reward.max_concurrent``, ``reward.max_rpm``, ``reward.max_tpm`` and ``reward.timeout`` (one reward-loop
  worker: verl's limiters are per process); its ``compute_score`` is :func:`judge_score`, a user's async reward
  function; ``run_single`` on a one-row ``DataProto`` per trajectory, all at once, as ``RewardLoopWorker.
  compute_score_batch`` runs them. On any error or timeout verl scores 0.0 and marks ``error``/``timeout`` in
  ``reward_extra_info``; it never retries.

Both ask the same chat completion (the user turn ``Question: ...\\nAnswer: <response>``, one token, temperature 0, the
top 20 log-probabilities) and compute the same score: the first judge token's probability among ``LOGITS_TOKENS``.
``--server vllm``: the tiny ``digit`` judge on vLLM's CPU server; ``--server scripted``: a scripted server answering
after :data:`SCRIPTED_LATENCY_S` (a smoke run). A :class:`~verl_async_rm.testing.fault_proxy.FaultProxy` stands in
front of the server in every pass; at each fault rate both sides get the same seeded schedule (the request of index
i, in arrival order, gets the same fault; request 0, the plugin's model list, none): 429 and 503 with ``Retry-After:
0.2``, 500, dropped connections, cut and non-JSON bodies. The reference is the plugin's scores with no fault, taken
first (it also warms the server up); then, per fault rate, the plugin's pass and verl's.

``--kind outcome``, the tiny sequence-classification RM at vLLM's ``/classify`` (``--server vllm``; ``scripted``: a
scripted server scoring each input by its length), through the plugin's RM service both ways, with the served
checkpoint as ``model_path``: ``batched`` (the default batching: one request carries a batch's token ids) and
``one per trajectory`` (``max_batch_size=1``: one request per trajectory, as the path before the one RM service sent
them, but at most 8 in flight, the slots of one endpoint, where that path sent up to ``max_concurrency``).

Prints a table; ``--out`` gets ``remote.json`` (and the vLLM server's log)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import statistics
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

__all__ = ["main", "judge_score", "close_judge_client"]

logger = logging.getLogger(__name__)

#: The plugin's judge prompt (Jinja) and the verl user's (``str.format``): the same text for the same trajectory.
JUDGE_PROMPT = "Question: {{ prompt }}\nAnswer: {{ response }}"
USER_PROMPT = "Question: {question}\nAnswer: {answer}"
#: The answers the trajectories give (``{s}``: the sum asked for, ``{t}``: another number); their last tokens vary.
ANSWERS = ("It is {s}.", "{s}", "four", "{a} + {b} = {s}", "The sum is {t}", "I think {t}, maybe", "no idea",
           "Let me see: {a} and {b} make {s}", "{t}?", "It is {t}, I am sure of it")
FAULT_KINDS = ("rate_limit", "server_error", "unavailable", "drop", "truncate", "bad_json")
RETRY_AFTER = "0.2"
#: The scripted server's wait before each answer (``--server scripted``).
SCRIPTED_LATENCY_S = 0.05
#: Two scores are the same when they differ by at most this (the server's float32 log-probabilities, read alike).
SAME_ABS = 1e-6
_QUICK_TRAJECTORIES = 32

# ------------------------------------------------------------------------------------ the verl user's function

_HTTP: httpx.AsyncClient | None = None


async def judge_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, *, base_url: str,
                      model: str, prompt: str, judge_tokens: Any, **kwargs: Any) -> dict[str, float]:
    """verl's side: a user's async reward function for ``rate_limited``, written as verl's reward-loop docs show one
    (``docs/advance/reward_loop.rst``, "User-Customized Reward Function": build the judge's prompt and request, send
    it, parse the answer, an answer that does not parse scores 0). ``reward_kwargs`` give the endpoint's base URL, the
    model, the prompt (``{question}`` from ``extra_info``, ``{answer}``) and the judge tokens. An HTTP error or a body
    that is not JSON raises: verl's manager then scores 0.0 and marks ``error``."""
    messages = [{"role": "user", "content": prompt.format(question=extra_info["question"], answer=solution_str)}]
    request = {"model": model, "messages": messages, "max_completion_tokens": 1, "temperature": 0.0, "logprobs": True,
               "top_logprobs": 20}
    response = await _client().post(f"{base_url}/chat/completions", json=request)
    response.raise_for_status()
    result = response.json()
    try:  # the judge's answer: its first token's log-probabilities, the first judge token's share of their odds
        top = {e["token"]: e["logprob"] for e in result["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
        odds = [math.exp(top[token]) for token in judge_tokens]
        score = odds[0] / sum(odds)
    except Exception:
        score = 0.0
    return {"score": score}


def _client() -> httpx.AsyncClient:
    """One client for every call (httpx's advice: a pooled client; building one loads TLS certificates, ~0.17 s of
    CPU each on the 2-core machine the docs' figures come from). No client timeout: ``reward.timeout`` bounds each
    call, as the ``ClientTimeout(total=None)`` of the docs' example leaves it."""
    global _HTTP
    if _HTTP is None:
        _HTTP = httpx.AsyncClient(timeout=None)
    return _HTTP


async def close_judge_client() -> None:
    """Close :func:`judge_score`'s client (the next call opens a new one)."""
    global _HTTP
    client, _HTTP = _HTTP, None
    if client is not None:
        await client.aclose()


# --------------------------------------------------------------------------------------------- the benchmark


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-async-rm bench remote", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("judge", "outcome"), default="judge",
                        help="judge (default): the plugin against verl's rate_limited manager; outcome: an outcome "
                             "RM's /classify, batched against one request per trajectory")
    parser.add_argument("--server", choices=("vllm", "scripted"), default=None,
                        help="vllm (default): the tiny digit judge on vLLM's CPU server; scripted: a scripted server "
                             f"answering after {SCRIPTED_LATENCY_S * 1e3:g} ms")
    parser.add_argument("--trajectories", type=int, default=None, help="trajectories per pass (default 256)")
    parser.add_argument("--max-concurrency", type=int, default=16,
                        help="requests in flight: the plugin's max_concurrency, verl's reward.max_concurrent")
    parser.add_argument("--max-rpm", type=float, default=None,
                        help="requests per minute: the plugin's max_rpm, verl's reward.max_rpm (default: no limit)")
    parser.add_argument("--faults", default="0,0.2", help="injected fault rates, comma-separated (default 0,0.2)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="the plugin's deadline per trajectory, verl's reward.timeout (default 300, verl's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes of each side per fault rate, the sides alternating which goes first (default "
                             "1); the table gives each pass, then per side the median wall time and real scores/s")
    parser.add_argument("--seed", type=int, default=0, help="the trajectories' answers and the fault schedule")
    parser.add_argument("--out", default=None, help="folder for remote.json (default: none written)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: --server scripted, {_QUICK_TRAJECTORIES} trajectories")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[float]:
    if args.quick and args.server == "vllm":
        parser.error("--quick runs the scripted server: drop --quick to run --server vllm")
    args.server = args.server or ("scripted" if args.quick else "vllm")
    if args.trajectories is None:
        args.trajectories = _QUICK_TRAJECTORIES if args.quick else 256
    try:
        rates = [float(r) for r in str(args.faults).split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or not all(0.0 <= r < 1.0 for r in rates):
        parser.error(f"--faults {args.faults!r}: give rates in [0, 1), comma-separated, e.g. 0,0.2")
    if (args.trajectories < 1 or args.max_concurrency < 1 or args.timeout_s <= 0 or args.repeats < 1
            or (args.max_rpm is not None and args.max_rpm <= 0)):
        parser.error("need --trajectories >= 1, --max-concurrency >= 1, --repeats >= 1, --timeout-s > 0 and "
                     "--max-rpm > 0")
    return rates


def _scripted_answer(payload: dict) -> Any:
    """The scripted judge: one token, the judge tokens' log-probabilities a fixed function of the user turn."""
    from verl_async_rm.testing.fault_proxy import Completion
    from verl_async_rm.testing.judges import LOGITS_TOKENS

    h = zlib.crc32(str(payload["messages"][-1]["content"]).encode())
    top = {LOGITS_TOKENS[0]: -0.1 - (h % 997) / 400, LOGITS_TOKENS[1]: -0.1 - (h // 997 % 997) / 400, "7": -4.0}
    ranked = dict(sorted(top.items(), key=lambda kv: -kv[1]))
    return Completion(next(iter(ranked)), top_logprobs=[ranked], completion_tokens=1)


@contextlib.contextmanager
def _server(args: argparse.Namespace, out_dir: Path | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """The RM's server for the whole run: (base URL, facts for the report)."""
    judge = args.kind == "judge"
    if args.server == "scripted":
        from verl_async_rm.testing.fault_proxy import ScriptedUpstream

        answers = {"chat": _scripted_answer} if judge else {"classify": lambda item: [len(item) / 10.0]}
        with ScriptedUpstream(**answers, models=("judge" if judge else "rm",), latency_s=SCRIPTED_LATENCY_S,
                              timeout_s=3600.0, max_requests=10**7) as server:
            yield server.url, {"server": "scripted", "latency_s": SCRIPTED_LATENCY_S}
        return
    import tempfile

    from verl_async_rm.testing.judges import build_tiny_judges
    from verl_async_rm.testing.models import build_tiny_models
    from verl_async_rm.testing.vllm_server import start_vllm_server

    path, name = (build_tiny_judges().digit, "judge") if judge else (build_tiny_models().rm, "rm")
    with tempfile.TemporaryDirectory(prefix="bench_remote_") as tmp:
        t0 = time.perf_counter()
        with start_vllm_server(path, name=name, log_dir=out_dir or tmp) as server:
            yield server.url, {"server": "vllm", "vllm": metadata.version("vllm"), "model": f"tiny {name}",
                               "model_path": str(path), "start_s": round(time.perf_counter() - t0, 1),
                               "flags": "--dtype float32 --enforce-eager --max-model-len 1024 --max-num-seqs 8"}


def _trajectories(tokenizer: Any, n: int, seed: int) -> list[tuple[Any, str]]:
    """``n`` trajectories (the request, and the question as text), answers drawn from :data:`ANSWERS`."""
    from verl_async_rm.request import RMRequest

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        question = f"What is {a} + {b}?"
        answer = rng.choice(ANSWERS).format(a=a, b=b, s=a + b, t=rng.randint(0, 999))
        prompt = [{"role": "user", "content": question}]
        out.append((RMRequest(
            uid=f"t{i}", raw_prompt=prompt, group=f"t{i}", ground_truth=str(a + b),
            prompt_ids=tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False),
            response_ids=tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]),
            question))
    return out


def _rows(tokenizer: Any, trajectories: list[tuple[Any, str]]) -> list[Any]:
    """One one-row ``DataProto`` per trajectory, as verl's agent loop hands it to the reward loop: the prompt padded
    on the left, the response on the right, a mask over both, and the dataset's fields."""
    import numpy as np
    import torch
    from verl import DataProto

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width_p = max(len(r.prompt_ids) for r, _ in trajectories)
    width_r = max(len(r.response_ids) for r, _ in trajectories)
    rows = []
    for request, question in trajectories:
        p, r = request.prompt_ids, request.response_ids
        prompts = torch.tensor([[pad] * (width_p - len(p)) + p])
        responses = torch.tensor([r + [pad] * (width_r - len(r))])
        mask = torch.tensor([[0] * (width_p - len(p)) + [1] * (len(p) + len(r)) + [0] * (width_r - len(r))])
        fields = {"data_source": "bench/remote", "reward_model": {"ground_truth": request.ground_truth},
                  "extra_info": {"question": question}, "uid": request.group, "tool_extra_fields": {}}
        rows.append(DataProto.from_dict(
            tensors={"prompts": prompts, "responses": responses, "attention_mask": mask,
                     "input_ids": torch.cat([prompts, responses], dim=1)},
            non_tensors={**{k: np.array([v], dtype=object) for k, v in fields.items()},
                         "__num_turns__": np.array([2])}))
    return rows


def _verl_config(args: argparse.Namespace, url: str) -> Any:
    """The reward part of verl's trainer config for ``rate_limited`` with :func:`judge_score` (what the reward loop
    reads; on verl's command line: ``reward.reward_manager.name=rate_limited +reward.max_concurrent=...``)."""
    from omegaconf import OmegaConf

    from verl_async_rm.testing.judges import LOGITS_TOKENS

    return OmegaConf.create({"reward": {
        "reward_manager": {"source": "register", "name": "rate_limited"},
        "custom_reward_function": {"path": f"pkg://{__name__}", "name": "judge_score", "reward_kwargs": {
            "base_url": url, "model": "judge", "prompt": USER_PROMPT, "judge_tokens": list(LOGITS_TOKENS)}},
        "max_concurrent": args.max_concurrency, "max_rpm": args.max_rpm, "max_tpm": None, "timeout": args.timeout_s}})


async def _plugin_pass(args: argparse.Namespace, policy: Path, url: str, trajectories: list,
                       batch_size: int | None = None) -> dict[str, Any]:
    from verl_async_rm.scoring.rm_config import RMConfig
    from verl_async_rm.service.batching import BatchPolicy
    from verl_async_rm.service.service import RMService
    from verl_async_rm.testing.judges import LOGITS_TOKENS
    from verl_async_rm.testing.models import build_tiny_models

    kind = ({"reward_kind": "judge", "judge_prompt": JUDGE_PROMPT, "judge_tokens": LOGITS_TOKENS}
            if args.kind == "judge" else {"model_path": str(build_tiny_models().rm)})
    config = RMConfig(endpoint=url, policy_tokenizer_path=str(policy), use_gpu=False, **kind,
                      max_concurrency=args.max_concurrency, max_rpm=args.max_rpm)
    policy_ = BatchPolicy() if batch_size is None else BatchPolicy(max_batch_size=batch_size)
    service = RMService(config, policy_, name="bench_remote")
    await service.start()
    cooldowns: set[float] = set()
    watcher = asyncio.ensure_future(_watch_cooldowns(service, cooldowns))
    try:
        await service.begin_step()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(service.score(r, args.timeout_s) for r, _ in trajectories))
        wall = time.perf_counter() - t0
        figures = await service.end_step()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await service.close()
    lost = [isinstance(r, BaseException) for r in results]
    return {"wall_s": wall, "scores": [None if bad else float(r) for r, bad in zip(results, lost)],
            "defaulted": [False] * len(results), "errors": sorted({type(r).__name__ for r in results if
                                                                 isinstance(r, BaseException)}),
            "plugin": {**figures, "cooldowns": len(cooldowns)}}


async def _watch_cooldowns(service: Any, seen: set[float], every_s: float = 0.05) -> None:
    """Add to ``seen`` the end of each cool-down of the service's endpoints (read from ``stats()`` every
    ``every_s``; a cool-down lasts ``COOLDOWN_S``, so none is missed). Its client's own ``cooldowns`` counter leaves
    out a cool-down that starts while a ``Retry-After`` keeps the endpoint out."""
    loop = asyncio.get_running_loop()
    while True:
        for endpoint in (await service.stats())["endpoint"]["endpoints"].values():
            if endpoint["out_reason"] == "cool-down":
                seen.add(round(loop.time() + endpoint["out_for_s"], 1))
        await asyncio.sleep(every_s)


async def _verl_pass(args: argparse.Namespace, tokenizer: Any, url: str, rows: list) -> dict[str, Any]:
    from verl.experimental.reward_loop.reward_manager.limited import RateLimitedRewardManager
    from verl.trainer.ppo.reward import load_reward_manager

    # verl's limiters are class attributes set by the first manager a process builds: each pass gets fresh ones, as a
    # fresh reward-loop worker would (verl's own tests of the manager reset them alike)
    RateLimitedRewardManager._class_initialized = False
    manager = load_reward_manager(_verl_config(args, url), tokenizer, reward_router_address=None,
                                  reward_model_tokenizer=None)
    if not isinstance(manager, RateLimitedRewardManager):
        raise TypeError(f"verl built {type(manager).__name__} for 'rate_limited', not RateLimitedRewardManager")
    try:
        _client()  # opened before the clock starts, as the plugin's client is (in start())
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(manager.run_single(row) for row in rows), return_exceptions=True)
        wall = time.perf_counter() - t0
    finally:
        await close_judge_client()
    lost = [isinstance(o, BaseException) for o in outs]
    infos = [{} if bad else o["reward_extra_info"] for o, bad in zip(outs, lost)]
    return {"wall_s": wall, "scores": [None if bad else float(o["reward_score"]) for o, bad in zip(outs, lost)],
            "defaulted": [bool(info.get("error") or info.get("timeout")) for info in infos],
            "errors": sorted({type(o).__name__ for o in outs if isinstance(o, BaseException)}),
            "verl": {"timeouts": sum(bool(i.get("timeout")) for i in infos),
                     "error_marks": Counter(str(i["error"])[:60] for i in infos if i.get("error")).most_common(5)}}


async def _pass(side: str, rate: float, args: argparse.Namespace, server_url: str, run: Any) -> dict[str, Any]:
    """One pass of ``side`` through a fresh fault proxy at ``rate``; what it measured and what the proxy saw."""
    from verl_async_rm.testing.fault_proxy import FaultProxy, FaultSchedule

    schedule = FaultSchedule(plan={0: None}, rate=rate, kinds=FAULT_KINDS, seed=args.seed, retry_after=RETRY_AFTER)
    route = "/chat/completions" if args.kind == "judge" else "/classify"
    with FaultProxy(server_url, schedule, timeout_s=3600.0, max_requests=10**7) as proxy:
        result = await run(proxy.url)
        chats = [s for s in proxy.seen if s.path.endswith(route)]
    logger.info("bench remote: %s at %g faults: %.2f s", side, rate, result["wall_s"])
    return {"side": side, "fault_rate": rate, **result, "endpoint_requests": len(chats),
            "faults_injected": sum(s.fault is not None for s in chats),
            "faults_by_kind": dict(Counter(s.fault for s in chats if s.fault)),
            "asked": sorted({json.dumps(s.body, sort_keys=True) for s in chats})}


def _summary(run: dict[str, Any], reference: list[float | None], n: int) -> dict[str, Any]:
    scores, defaulted = run.pop("scores"), run.pop("defaulted")
    kept = [(s, ref) for s, ref, d in zip(scores, reference, defaulted) if s is not None and not d and ref is not None]
    equal = sum(s is not None and ref is not None and abs(s - ref) <= SAME_ABS for s, ref in zip(scores, reference))
    return {**run, "trajectories": n, "real_scores_per_s": equal / run["wall_s"],
            "lost": sum(s is None for s in scores), "defaulted": sum(defaulted), "equal_to_reference": equal,
            "max_abs_diff_scored": max((abs(s - ref) for s, ref in kept), default=None),
            "retries": run.get("plugin", {}).get("endpoint_retries", run["endpoint_requests"] - n)}


async def _passes(args: argparse.Namespace, rates: list[float], url: str) -> dict[str, Any]:
    from verl.utils import hf_tokenizer

    from verl_async_rm.testing.models import build_tiny_models

    policy = build_tiny_models().policy
    tokenizer = hf_tokenizer(str(policy), trust_remote_code=True)  # as verl's RewardLoopWorker loads it
    trajectories = _trajectories(tokenizer, args.trajectories, args.seed)
    rows = _rows(tokenizer, trajectories)
    n = len(trajectories)

    def plugin(proxy_url: str) -> Any:
        return _plugin_pass(args, policy, proxy_url, trajectories)

    def verl(proxy_url: str) -> Any:
        return _verl_pass(args, tokenizer, proxy_url, rows)

    def single(proxy_url: str) -> Any:
        return _plugin_pass(args, policy, proxy_url, trajectories, batch_size=1)

    pair = [("plugin", plugin), ("verl", verl)] if args.kind == "judge" else \
        [("batched", plugin), ("one per trajectory", single)]
    first = await _pass(pair[0][0], 0.0, args, url, pair[0][1])
    reference = first["scores"]
    runs = []
    for rate in rates:
        for repeat in range(args.repeats):  # the sides take turns going first: a drift in load hits both alike
            for side, fn in pair[::1 if repeat % 2 == 0 else -1]:
                runs.append({"repeat": repeat, **_summary(await _pass(side, rate, args, url, fn), reference, n)})
    for run in runs:  # both sides sent the same requests (each side's distinct bodies, compared as a set)
        other = next(r for r in runs if r["fault_rate"] == run["fault_rate"] and r["repeat"] == run["repeat"]
                     and r["side"] != run["side"])
        run["asked_as_other_side"] = run["asked"] == other["asked"] if args.kind == "judge" else None
    for run in runs:
        run.pop("asked")
    return {"reference": {"wall_s": first["wall_s"], "scored": sum(s is not None for s in reference),
                          "distinct_scores": len({round(s, 6) for s in reference if s is not None})},
            "runs": runs}


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def format_table(report: dict[str, Any]) -> str:
    p, ref, env = report["params"], report["reference"], report["environment"]
    lines = [f"bench remote ({p['kind']}): {p['trajectories']} trajectories, server {report['server']['server']}, "
             f"max concurrency {p['max_concurrency']}, max rpm {p['max_rpm']}, timeout {p['timeout_s']:g} s; "
             f"reference: {ref['scored']} scored ({ref['distinct_scores']} distinct scores); {env['cpus']} CPUs, "
             f"1-minute load average {report['load_avg_1min_before']} before, {env['load_avg_1min']} after",
             "| side | faults | trajectories | wall s | real scores/s | lost | defaulted to 0.0 | equal to reference "
             "| retries | faults injected | endpoint cool-downs |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        cooldowns = r["plugin"]["cooldowns"] if "plugin" in r else "-"
        lines.append(f"| {r['side']} | {r['fault_rate']:.0%} | {r['trajectories']} | {r['wall_s']:.2f} | "
                     f"{r['real_scores_per_s']:,.1f} | {r['lost']} | {r['defaulted']} | {r['equal_to_reference']} | "
                     f"{r['retries']} | {r['faults_injected']} | {cooldowns} |")
    if p["repeats"] > 1:
        sides = list(dict.fromkeys(r["side"] for r in report["runs"]))
        for rate in sorted({r["fault_rate"] for r in report["runs"]}):
            runs = {side: [r for r in report["runs"] if r["side"] == side and r["fault_rate"] == rate]
                    for side in sides}
            wall, real = ({side: statistics.median(r[key] for r in runs[side]) for side in runs}
                          for key in ("wall_s", "real_scores_per_s"))
            lines.append(f"median at {rate:.0%} faults over {p['repeats']} passes: wall s "
                         + ", ".join(f"{side} {wall[side]:.2f}" for side in sides) + "; real scores/s "
                         + ", ".join(f"{side} {real[side]:.1f}" for side in sides))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> tuple[int, str]:
    """Entry point of ``verl-async-rm bench remote``: runs it, writes the JSON; returns (exit status, report text)."""
    from verl_async_rm.bench.environment import environment_snapshot

    parser = build_parser()
    args = parser.parse_args(argv)
    rates = _check(parser, args)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    load_before = _load()
    with _server(args, out_dir) as (url, server):
        results = asyncio.run(_passes(args, rates, url))
    report = {"benchmark": "remote", "environment": environment_snapshot(), "load_avg_1min_before": load_before,
              "server": server,
              "params": {**vars(args), "faults": rates, "fault_kinds": FAULT_KINDS, "retry_after": RETRY_AFTER,
                         "same_abs": SAME_ABS},
              **results}
    text = format_table(report)
    if out_dir is not None:
        path = out_dir / "remote.json"
        path.write_text(json.dumps(report, indent=2))
        text += f"\n\nwrote {path}"
    return 0, text
