"""``verl-async-rm demo``: the plugin next to verl's synchronous scoring and verl's own vLLM-served RM, on verl's v1
trainer and verl's vLLM rollout, on a CPU machine.

- :mod:`~verl_async_rm.demo.options`: :class:`DemoConfig`;
- :mod:`~verl_async_rm.demo.run`: :func:`run_demo`, the orchestration;
- :mod:`~verl_async_rm.demo.cluster`: its own local Ray cluster (TransferQueue runs in it), shut down and checked to
  leave no process;
- :mod:`~verl_async_rm.demo.models`: the demo RM; :mod:`~verl_async_rm.demo.rule`: the rule reward;
- :mod:`~verl_async_rm.demo.workload`: verl overrides (the plugin's, verl's served RM's, the rollout's), prompts;
- :mod:`~verl_async_rm.demo.agent_loop`: the agent loop (a heavy-tailed length per trajectory, greedy);
- :mod:`~verl_async_rm.demo.served_rm`: verl's served RM built as verl's trainer builds it, with request timings;
- :mod:`~verl_async_rm.demo.modes`: one step of verl's v1 fit loop, async, sync or verl_served;
- :mod:`~verl_async_rm.demo.timeline`: per-step records and figures (pure);
- :mod:`~verl_async_rm.demo.summary`, :mod:`~verl_async_rm.demo.plot`: JSON summary, table, PNG timeline.
"""

from verl_async_rm.demo.options import DemoConfig
from verl_async_rm.demo.run import DemoResult, run_demo

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
