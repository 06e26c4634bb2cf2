"""A CPU stand-in for verl's vLLM server, usable behind verl's real ``LLMServerClient``.

The demo and the trainer-level tests use verl's own ``vLLMReplica`` (:mod:`verl_async_rm.testing.vllm_rollout`);
this stand-in serves the tests that must control time exactly (a response's length and decode time, a trajectory
held back). It replaces only the server: :class:`CPUGenerationServer` is a Ray actor whose ``generate`` has the
signature of verl 0.9.1's ``vLLMHttpServer.generate`` and returns verl's ``TokenOutput``. Everything in front of it
(the router, ``verl.workers.rollout.router.get_router_handle``; ``LLMServerClient``; the agent loops) is verl's own
code.

No model runs: response lengths are drawn from a heavy-tailed (log-normal) distribution, tokens are random ordinary
tokens, and each request takes a simulated decode time per token (``asyncio.sleep``), with any number of requests in
flight, the way a continuous-batching server behaves. Deterministic per (seed, prompt, n-th repeat of that prompt).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["LengthDistribution", "CPUGenerationServer", "start_generation_servers", "start_load_balancer",
           "make_llm_client"]


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal response lengths, clipped to ``[min_tokens, max_tokens]`` (and to the request's budget).

    Log-normal with ``sigma`` around 0.8-1.2 gives the long tail seen in RL rollouts: most responses near the
    median, a few many times longer.
    """

    median_tokens: float = 32.0
    sigma: float = 1.0
    min_tokens: int = 1
    max_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.median_tokens > 0:
            raise ValueError(f"LengthDistribution.median_tokens must be > 0, got {self.median_tokens!r}")
        if not self.sigma >= 0:
            raise ValueError(f"LengthDistribution.sigma must be >= 0, got {self.sigma!r}")
        if self.min_tokens < 1:
            raise ValueError(f"LengthDistribution.min_tokens must be >= 1, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(
                f"LengthDistribution.max_tokens ({self.max_tokens}) must be >= min_tokens ({self.min_tokens})"
            )

    def sample(self, rng: random.Random, budget: int) -> int:
        n = int(round(rng.lognormvariate(math.log(self.median_tokens), self.sigma)))
        upper = budget if self.max_tokens is None else min(budget, self.max_tokens)
        return max(1, min(max(n, self.min_tokens), upper))


class CPUGenerationServer:
    """Token-in/token-out generation server with verl's vLLM server ``generate`` signature (see module doc).

    Args:
        model_path: local HF folder whose tokenizer supplies the vocabulary and the special tokens to avoid (else
            ``vocab_size`` is used).
        prompt_length, response_length: the rollout's lengths; the default ``max_tokens`` is computed from them as
            verl's vLLM server does.
        seed: seeds sampling.
        lengths: response-length distribution.
        decode_s_per_token, prefill_s: simulated time of a request: ``prefill_s + n * decode_s_per_token``.
        vocab_size: vocabulary when no ``model_path`` is given.
        steps, step_text: responses of ``steps`` parts joined by ``step_text`` (tokenized with the
            model's tokenizer; parts then use only tokens with visible, newline-free text), for process RMs.
    """

    def __init__(
        self,
        model_path: Optional[str] = None,
        *,
        prompt_length: int = 256,
        response_length: int = 64,
        seed: int = 0,
        lengths: Optional[LengthDistribution] = None,
        decode_s_per_token: float = 0.0,
        prefill_s: float = 0.0,
        vocab_size: int = 256,
        steps: int = 1,
        step_text: str = "\n\n",
    ) -> None:
        if decode_s_per_token < 0 or prefill_s < 0:
            raise ValueError(
                f"simulated times must be >= 0, got decode_s_per_token={decode_s_per_token}, prefill_s={prefill_s}"
            )
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.max_model_len = prompt_length + response_length
        self.seed = seed
        self.lengths = lengths or LengthDistribution()
        self.decode_s_per_token = decode_s_per_token
        self.prefill_s = prefill_s
        self._seen: Counter = Counter()
        self.num_requests = 0
        self._finished: list[dict[str, Any]] = []
        self._eos: list[int] = []
        self._ordinary = list(range(vocab_size))
        self.steps = steps
        self._step_ids: list[int] = []
        if steps > 1 and not model_path:
            raise ValueError("CPUGenerationServer(steps > 1) needs model_path: its tokenizer writes step_text")
        if model_path:
            self._load(model_path, step_text if steps > 1 else None)

    def _load(self, model_path: str, step_text: Optional[str] = None) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        specials = set(tok.all_special_ids)
        self._ordinary = [i for i in range(len(tok)) if i not in specials]
        if step_text is not None:
            self._step_ids = tok(step_text, add_special_tokens=False)["input_ids"]
            self._ordinary = [i for i in self._ordinary if (t := tok.decode([i])).strip() and "\n" not in t]
        self._eos = [tok.eos_token_id] if tok.eos_token_id is not None else []

    def _rng(self, prompt_ids: list[int]) -> random.Random:
        key = tuple(prompt_ids)
        nth = self._seen[key]
        self._seen[key] += 1
        digest = hashlib.sha256(repr((self.seed, key, nth)).encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "little"))

    def _max_tokens(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> int:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"Prompt length ({len(prompt_ids)}) leaves no room to generate within max_model_len "
                f"({self.max_model_len})"
            )
        asked = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        if asked is None:
            asked = min(self.response_length, self.max_model_len - len(prompt_ids))
        return max(1, min(int(asked), room))

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        audio_data: Optional[list[Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        priority: int = 0,
        kv_transfer_params: Optional[dict] = None,
    ):
        """Generate a response for ``prompt_ids``; returns ``verl.workers.rollout.replica.TokenOutput``."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or audio_data:
            raise ValueError("CPUGenerationServer is text-only: image/video/audio data are not supported")
        prompt_ids = [int(t) for t in prompt_ids]
        max_tokens = self._max_tokens(prompt_ids, sampling_params)
        rng = self._rng(prompt_ids)
        self.num_requests += 1
        # ignore_eos: exactly max_tokens, as vLLM does (the demo's agent loop draws each length itself)
        n = max_tokens if sampling_params.get("ignore_eos") else self.lengths.sample(rng, max_tokens)
        delay = self.prefill_s + n * self.decode_s_per_token
        if delay > 0:
            await asyncio.sleep(delay)
        ids = [rng.choice(self._ordinary) for _ in range(n - 1)] + [self._eos[0] if self._eos else 0]
        ids = ids[:n]
        if self.steps > 1:  # the same budget, as `steps` parts of about equal length joined by step_text
            k, eos = self.steps, ids[-1]
            body = [rng.choice(self._ordinary) for _ in range(max(k, n - 1 - (k - 1) * len(self._step_ids)))]
            size = len(body) // k
            parts = [body[j * size : (j + 1) * size] for j in range(k - 1)] + [body[(k - 1) * size :]]
            ids = [t for j, part in enumerate(parts) for t in (self._step_ids if j else []) + part] + [eos]
            n = len(ids)
        logps = [-1.0] * n
        self._finished.append({"request_id": str(request_id), "end": time.time(), "tokens": len(ids)})
        want_logprobs = bool(sampling_params.get("logprobs"))
        return TokenOutput(
            token_ids=ids, log_probs=logps if want_logprobs else None, stop_reason="completed", num_preempted=0
        )

    def stats(self) -> dict:
        return {"num_requests": self.num_requests}

    def pop_finished(self) -> list[dict[str, Any]]:
        """Requests answered since the previous call: ``{"request_id", "end" (time.time()), "tokens"}``, in order."""
        finished, self._finished = self._finished, []
        return finished

    def reset(self) -> None:
        """Forget which prompts were seen (a repeated workload then gets the same lengths) and the finish records."""
        self._seen.clear()
        self._finished = []


#: How long :func:`start_generation_servers` and :func:`make_llm_client` wait for their actors to start. Each is a
#: process that imports verl (seconds of CPU); on a loaded machine (a test suite beside training runs) that can take
#: minutes, and it should not eat into a caller's deadline for the requests themselves.
START_TIMEOUT_S = 600.0


def start_generation_servers(num_servers: int = 1, *, name_prefix: str = "cpu_gen",
                             start_timeout_s: float = START_TIMEOUT_S, **server_kwargs) -> dict:
    """Start ``num_servers`` :class:`CPUGenerationServer` actors and wait until they are up (raises
    ``ray.exceptions.GetTimeoutError`` after ``start_timeout_s``); returns ``{address: handle}`` for verl's router.

    The addresses are labels (no socket is opened); verl's load balancer only uses them as keys.
    """
    import ray

    actor_cls = ray.remote(num_cpus=0)(CPUGenerationServer).options(max_concurrency=4096)
    servers = {f"{name_prefix}-{i}": actor_cls.remote(**server_kwargs) for i in range(num_servers)}
    ray.get([handle.__ray_ready__.remote() for handle in servers.values()], timeout=start_timeout_s)
    return servers


def start_load_balancer(servers: dict, *, full_determinism: bool = False, start_timeout_s: float = START_TIMEOUT_S):
    """verl's load balancer over ``servers`` (``verl.workers.rollout.router.get_router_handle``), once it is up."""
    import ray
    from verl.workers.rollout.router import get_router_handle

    balancer = get_router_handle(servers, full_determinism=full_determinism)
    ray.get(balancer.__ray_ready__.remote(), timeout=start_timeout_s)
    return balancer


def make_llm_client(config, servers: dict):
    """verl's real ``LLMServerClient`` over ``servers`` (``{address: handle}``), routed by verl's load balancer
    (:func:`start_load_balancer`)."""
    from verl.workers.rollout.llm_server import LLMServerClient

    full_det = bool(getattr(config.actor_rollout_ref.rollout, "full_determinism", False))
    return LLMServerClient(config=config, load_balancer_handle=start_load_balancer(servers, full_determinism=full_det))
