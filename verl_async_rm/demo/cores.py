"""Give the rollout and the RM cores of their own, as a cluster gives them GPUs of their own.

On a cluster the policy's rollout and the RM run on different GPUs: scoring a finished trajectory does not slow the
trajectories still decoding. On a small CPU machine every process shares every core, so scoring during the rollout
would slow the rollout by exactly the compute it takes, and no way of scheduling the RM could win. The demo therefore
splits the machine's cores in two (Linux CPU affinity of every thread of the processes, set once they have started):
the policy's vLLM engine gets the first half, the RM the second half, in every mode alike (the plugin's replicas, and
verl's served-RM engines). Everything else (agent loops, TransferQueue, Ray, the driver) keeps every core.

With fewer than two cores, or off Linux, nothing is pinned and the demo says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["actor_pid", "core_split", "pin_processes"]


def core_split() -> tuple[set[int], set[int]] | None:
    """``(rollout cores, RM cores)``: this process's allowed cores cut in two halves, or None with fewer than two."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def actor_pid(handle: Any, timeout_s: float = 60.0) -> int:
    """The pid of a Ray actor's process (``__ray_call__`` runs a function in the actor)."""
    import ray

    return int(ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=timeout_s))


def pin_processes(pids: Iterable[int], cores: Sequence[int] | set[int]) -> int:
    """Pin every thread of each process in ``pids`` and of all their descendants to ``cores``; returns how many
    threads were pinned. Threads they start later inherit the mask of the thread that starts them."""
    import psutil

    pinned = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    for thread in proc.threads():
                        with contextlib.suppress(OSError):
                            os.sched_setaffinity(thread.id, set(cores))
                            pinned += 1
    return pinned
