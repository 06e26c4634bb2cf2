"""``verl-async-rm demo``: GRPO with verl's own trainer (``python -m verl.trainer.main_ppo``) on a CPU machine, once per
mode: the plugin on its own pool, verl's own served RM, the plugin on the policy's GPU, no RM.

- :mod:`~verl_async_rm.demo.options`: :class:`DemoConfig`; :mod:`~verl_async_rm.demo.run`: :func:`run_demo`, one
  ``main_ppo`` subprocess per mode;
- :mod:`~verl_async_rm.demo.modes`: each mode's verl overrides; :mod:`~verl_async_rm.demo.data`: the tiny models and
  prompt files (also the defaults of ``recipes/grpo_cpu_tiny.sh``); :mod:`~verl_async_rm.demo.models`: the demo RM;
- :mod:`~verl_async_rm.demo.agent_loop`: the agent loop (heavy-tailed response lengths);
  :mod:`~verl_async_rm.demo.sampler`: verl's replay buffer with the rollout and reward-tail times;
  :mod:`~verl_async_rm.demo.rule`: the no-RM mode's reward; :mod:`~verl_async_rm.demo.served_reward`: how the
  verl_served mode reaches verl's served RM;
- :mod:`~verl_async_rm.demo.summary`, :mod:`~verl_async_rm.demo.plot`: ``summary.json``, the report,
  ``reward_curve.png``.

:mod:`~verl_async_rm.demo.served_rm` (verl's served RM built standalone, with verl issue 7368's fix) serves the
real-vLLM tests.
"""

from verl_async_rm.demo.options import DemoConfig
from verl_async_rm.demo.run import DemoResult, run_demo

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
