"""The smoke run behind ``verl-async-rm smoke``: verl loads the plugin, the tiny models build, verl's router answers.

It stands in for the demo until the demo lands: it imports verl (which loads the ``verl.plugins`` entry point),
builds the tiny models, starts a local Ray cluster with one CPU generation server, and sends one chat prompt through
verl's real ``LLMServerClient``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["smoke"]


def smoke(cache_dir: str | None = None, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the smoke check and return what it saw (raises on any failure)."""
    import ray

    t0 = time.perf_counter()
    import verl  # noqa: F401  (loads the verl.plugins entry points)

    if "verl_async_rm.plugin" not in sys.modules:
        raise RuntimeError(
            "import verl did not load the verl_async_rm plugin: is the package installed (pip install -e .) and "
            "VERL_USE_EXTERNAL_PLUGINS unset or 'auto'?"
        )
    from verl_async_rm.testing import build_tiny_models, compose_trainer_config, make_llm_client
    from verl_async_rm.testing import start_generation_servers

    models = build_tiny_models(cache_dir)
    config = compose_trainer_config(models.policy, trainer="v0")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        servers = start_generation_servers(1, mode="hf", model_path=str(models.policy), response_length=16)
        client = make_llm_client(config, servers)

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(models.policy)
        messages = [{"role": "user", "content": "how many apples are left?"}]
        prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

        async def ask():
            return await asyncio.wait_for(
                client.generate("smoke-0", prompt_ids=list(prompt_ids), sampling_params={"temperature": 0.0}),
                timeout=timeout_s,
            )

        out = asyncio.run(ask())
        return {
            "verl_plugin_loaded": True,
            "models": str(models.root),
            "prompt_tokens": len(prompt_ids),
            "response_tokens": len(out.token_ids),
            "response_text": tok.decode(out.token_ids),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    finally:
        if started_ray:
            ray.shutdown()
