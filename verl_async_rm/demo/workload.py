"""The demo's workload: verl overrides for the plugin and for verl's served RM, the prompts of each step, the rollout's
settings."""

from __future__ import annotations

from typing import Any

from verl_async_rm.demo import rule
from verl_async_rm.demo.options import DemoConfig
from verl_async_rm.testing.generation import LengthDistribution

__all__ = ["GROUND_TRUTH", "PROMPT_LENGTH", "prompt_uids", "prompts_batch", "rollout_overrides", "served_overrides",
           "server_kwargs", "verl_overrides"]

PROMPT_LENGTH = 64
GROUND_TRUTH = "42"
_QUESTIONS = (
    "a farmer has {a} apples and sells {b}; how many are left?",
    "a book costs {a} dollars and a pen {b}; what is the total cost?",
    "a train goes {a} miles in {b} hours; what is its speed?",
    "each box holds {a} eggs; how many eggs are in {b} boxes?",
)


def verl_overrides(config: DemoConfig, rm_path: str) -> list[str]:
    """The recipe overrides a user adds for the plugin, with the demo's RM, rule and batching.

    The same overrides serve verl's v1 trainer (the default, ``trainer.use_v1=True``), which the demo composes.
    """
    return [
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager",
        "reward.reward_model.enable_resource_pool=True",
        f"reward.reward_model.n_gpus_per_node={config.rm_replicas}",
        "reward.reward_model.nnodes=1",
        f"reward.reward_model.model_path={rm_path}",
        "reward.reward_manager.name=async_rm",
        f"reward.custom_reward_function.path={rule.__file__}",
        "reward.custom_reward_function.name=compute_score",
        f"+async_rm.rm_weight={config.rm_weight}",
        f"+async_rm.rule_weight={config.rule_weight}",
        f"+async_rm.max_batch_size={config.max_batch_size}",
        f"+async_rm.micro_batch_max_tokens={config.rm_micro_batch_tokens}",
        f"+async_rm.max_wait_ms={config.max_wait_ms}",
        # verl's served RM always re-renders the conversation with the RM's chat template; so does the plugin here,
        # so both read the same text and their scores compare (the default reuses the policy's token ids)
        "+async_rm.retemplate=always",
        "+async_rm.placement_timeout_s=120",
        f"+async_rm.request_timeout_s={config.step_timeout_s}",
        f"+async_rm.batch_timeout_s={config.step_timeout_s}",
    ]


def rollout_overrides(config: DemoConfig, agent_loops_yaml: str, *, vllm: bool) -> list[str]:
    """The rollout's overrides, the same in every mode: the demo's agent loop by default, and on ``vllm`` the settings
    verl's vLLM replica needs on CPU."""
    from verl_async_rm.demo.agent_loop import AGENT_NAME
    from verl_async_rm.testing.vllm_rollout import cpu_rollout_overrides

    loop = [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loops_yaml}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}"]
    return loop + (cpu_rollout_overrides(PROMPT_LENGTH + config.response_length) if vllm else [])


def served_overrides(config: DemoConfig, rm_path: str) -> list[str]:
    """verl's own served RM in place of the plugin: verl's reward manager, no custom reward function (verl's served
    path then scores with the RM alone), one vLLM engine per plugin replica on a pool of its own."""
    from verl_async_rm.testing.vllm_rollout import served_rm_overrides

    return [
        "reward.reward_manager.name=naive",
        "reward.custom_reward_function.path=null",
        *served_rm_overrides(rm_path, config.rm_replicas, max_model_len=2 * (PROMPT_LENGTH + config.response_length)),
    ]


def prompts_batch(step: int, size: int, *, tag: str = "step", mode: str = "demo") -> Any:
    """A v1 prompt batch (a TensorDict, as verl's dataloader gives it) of ``size`` single-turn prompts for ``step``.

    The questions depend only on ``step``, ``tag`` and ``i`` (the same prompts, hence the same lengths and responses,
    in every mode); the uids, ``{mode}-{tag}{step}-{i}``, also name the mode, so no two modes share a key in
    TransferQueue. verl builds trajectory keys as ``{uid}_{session}_{index}``: a uid holds no ``_``. A fresh object
    each call (``global_steps`` is set by the fit loop at dispatch).
    """
    import torch
    from verl.utils import tensordict_utils as tu

    rows = [
        f"{tag} {step} question {i}: " + _QUESTIONS[i % len(_QUESTIONS)].format(a=7 + 3 * i + step, b=2 + i % 5)
        for i in range(size)
    ]
    return tu.get_tensordict(tensor_dict={
        "uid": prompt_uids(step, size, tag=tag, mode=mode),
        "raw_prompt": [[{"role": "user", "content": q}] for q in rows],
        "data_source": ["demo"] * size,
        "reward_model": [{"ground_truth": GROUND_TRUTH} for _ in rows],
        "index": torch.arange(size),
    })


def prompt_uids(step: int, size: int, *, tag: str = "step", mode: str = "demo") -> list[str]:
    """The uids :func:`prompts_batch` gives its rows, in row order."""
    if "_" in f"{mode}{tag}":
        raise ValueError(f"demo prompt uids may not contain '_' (verl splits trajectory keys on it): {mode!r}, {tag!r}")
    return [f"{mode}-{tag}{step}-{i}" for i in range(size)]


def server_kwargs(config: DemoConfig, policy_path: str) -> dict[str, Any]:
    """Settings of the stand-in CPU generation server (no vLLM): a simulated decode time per token; the lengths come
    from the demo's agent loop (``ignore_eos``)."""
    return {
        "mode": "synthetic",
        "model_path": policy_path,
        "prompt_length": PROMPT_LENGTH,
        "response_length": config.response_length,
        "seed": config.seed,
        "lengths": LengthDistribution(median_tokens=config.median_tokens, sigma=config.sigma),
        "decode_s_per_token": config.decode_s_per_token,
    }
