"""The demo's modes as verl command lines: each is ``python -m verl.trainer.main_ppo`` with the CPU trainer's
overrides (:mod:`verl_async_rm.testing.cpu_trainer`, as ``recipes/grpo_cpu_tiny.sh``), the demo's data, agent loop,
replay buffer and sizes, and what differs between the modes:

- ``plugin``: the README's opt-in, the RM on a pool of its own (one logical GPU, one CPU replica), reward = RM score;
- ``verl_served``: verl's own vLLM-served RM on a pool of its own (``reward.reward_model.enable=True``), one engine,
  reached through a custom reward function (:mod:`verl_async_rm.demo.served_reward`: verl 0.9.1's default path
  fails every trajectory), reward = RM score;
- ``plugin_colocated``: the plugin with the RM on the policy's GPU (``enable_resource_pool=False``), asleep during
  the update;
- ``no_rm``: no RM, the demo's rule reward (:mod:`verl_async_rm.demo.rule`) alone: the floor on step time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_async_rm.demo.options import DemoConfig

__all__ = ["LABELS", "mode_overrides"]

#: How the table and the figure name each mode.
LABELS = {
    "plugin": "plugin, own pool",
    "verl_served": "verl served RM",
    "plugin_colocated": "plugin, policy GPU",
    "no_rm": "no RM (rule)",
}


def mode_overrides(mode: str, config: DemoConfig, assets: Any, *, agent_loops: Path, record_path: Path,
                   ray_temp_dir: str) -> list[str]:
    """The Hydra overrides of one mode's ``main_ppo`` run (module doc)."""
    from verl_async_rm.demo import rule, served_reward
    from verl_async_rm.demo.agent_loop import AGENT_NAME
    from verl_async_rm.testing.cpu_trainer import cpu_trainer_overrides, plugin_overrides
    from verl_async_rm.testing.vllm_rollout import served_rm_overrides

    rm = str(assets.rm)
    rm_gpus = {"plugin": 1, "verl_served": 1, "plugin_colocated": 0, "no_rm": 0}[mode]
    base = cpu_trainer_overrides(
        policy_path=str(assets.policy), train_files=str(assets.train_file), val_files=str(assets.val_file),
        train_batch_size=config.prompts, rollout_n=config.rollout_n, max_response_length=config.response_length,
        lr=config.lr, rm_gpus=rm_gpus)
    if mode in ("plugin", "plugin_colocated"):
        reward = plugin_overrides(rm, rm_gpus=rm_gpus, extra=[
            "+async_rm.rm_weight=1.0", "+async_rm.rule_weight=0.0", "+async_rm.max_wait_ms=20",
            "+async_rm.placement_timeout_s=120",
            # verl's served RM renders the conversation with the RM's chat template; so does the plugin here, so
            # every mode's RM score is the same function of the same text (by default it reuses the policy's ids)
            "+async_rm.retemplate=always"])
    elif mode == "verl_served":
        reward = [*served_rm_overrides(rm, 1, max_model_len=256),
                  f"reward.custom_reward_function.path={served_reward.__file__}",
                  f"+reward.custom_reward_function.reward_kwargs.model_path={rm}"]
    else:
        reward = [f"reward.custom_reward_function.path={rule.__file__}"]
    manager_key = "+actor_rollout_ref.rollout.agent.agent_loop_manager_class"
    if config.trainer == "v1":  # the timeline from a replay buffer of the demo's
        from verl_async_rm.demo.sampler import TimedReplayBuffer
        from verl_async_rm.testing.replay_buffer import short_poll_overrides

        timeline = short_poll_overrides("sync", cls=TimedReplayBuffer)
    else:  # v0 has none: the manager times its batches (demo/v0_timing.py)
        timed = "TimedAsyncRMAgentLoopManager" if mode.startswith("plugin") else "TimedAgentLoopManager"
        reward = [o for o in reward if not o.startswith(manager_key + "=")]
        timeline = [f"{manager_key}=verl_async_rm.demo.v0_timing.{timed}", "trainer.use_v1=False"]
    run = [
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loops}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
        *timeline,
        f"+trainer.v1.sampler.sampler_kwargs.record_path={record_path}",
        f"trainer.total_training_steps={config.steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,file]",
        "trainer.project_name=verl_async_rm_demo",
        f"trainer.experiment_name={mode}",
        f"data.seed={config.seed}",
        "data.shuffle=False",
        f"actor_rollout_ref.actor.data_loader_seed={config.seed}",
        f"actor_rollout_ref.rollout.seed={config.seed}",
        f"+ray_kwargs.ray_init._temp_dir={ray_temp_dir}",
    ]
    return base + reward + run
