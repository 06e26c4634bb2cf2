"""``verl-async-rm demo``: the plugin next to verl's synchronous scoring, on verl's v1 trainer, on a CPU machine.

- :mod:`~verl_async_rm.demo.options`: :class:`DemoConfig`;
- :mod:`~verl_async_rm.demo.run`: :func:`run_demo`, the orchestration;
- :mod:`~verl_async_rm.demo.cluster`: its own local Ray cluster (TransferQueue runs in it), shut down and checked to
  leave no process;
- :mod:`~verl_async_rm.demo.models`: the demo RM; :mod:`~verl_async_rm.demo.rule`: the rule reward;
- :mod:`~verl_async_rm.demo.workload`: verl overrides, prompts, generation server settings;
- :mod:`~verl_async_rm.demo.modes`: one step of verl's v1 fit loop, async or sync;
- :mod:`~verl_async_rm.demo.timeline`: per-step records and figures (pure);
- :mod:`~verl_async_rm.demo.summary`, :mod:`~verl_async_rm.demo.plot`: JSON summary, table, PNG timeline.
"""

from verl_async_rm.demo.options import DemoConfig
from verl_async_rm.demo.run import DemoResult, run_demo

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
