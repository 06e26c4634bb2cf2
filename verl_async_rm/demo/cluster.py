"""The demo's own local Ray cluster: started by ``ray.init``, shut down in ``finally``, checked to leave nothing.

Every process of the cluster (GCS, raylet, workers...) descends from this process, so its pids are read from our own
process tree; after ``ray.shutdown()`` the demo waits for exactly those processes to exit and terminates (by pid)
any of them that did not. Other Ray clusters on the machine are never looked at. ``ray stop`` is never used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["LocalCluster", "alive", "local_cluster"]

#: Environment the cluster's processes inherit (set only where the user did not set it).
_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


@dataclass
class LocalCluster:
    """What the demo knows about its cluster: namespace, session dir, and ``{pid: create_time}`` of its processes."""

    namespace: str
    session_dir: str | None = None
    processes: dict[int, float] = field(default_factory=dict)
    left_behind: list[int] = field(default_factory=list)

    def track(self) -> None:
        """Record the cluster processes alive now (descendants of this process)."""
        import psutil

        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                self.processes[proc.pid] = proc.create_time()

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "session_dir": self.session_dir,
            "pids": [{"pid": pid, "create_time": t} for pid, t in sorted(self.processes.items())],
            "left_behind": list(self.left_behind),
        }


def alive(pid: int, create_time: float) -> bool:
    """Whether the process ``pid`` started at ``create_time`` still runs (a reused pid does not count)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def local_cluster(num_cpus: int = 8, num_gpus: int = 0, shutdown_timeout_s: float = 30.0) -> Iterator[LocalCluster]:
    """Start a fresh local Ray cluster (refuses if Ray is already initialised in this process); always shut it down.

    ``num_gpus`` logical GPUs for verl's vLLM pools on a CPU machine (verl has no CPU platform: its pools ask Ray for
    GPUs); each such pool's bundle also asks for a few CPUs, so ``num_cpus`` grows by 3 per GPU (logical resources).
    """
    import psutil
    import ray

    if ray.is_initialized():
        raise RuntimeError("the demo starts its own Ray cluster: call it from a process where Ray is not initialised")
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    cluster = LocalCluster(namespace=f"verl_async_rm_demo_{uuid.uuid4().hex[:8]}")
    ray.init(num_cpus=num_cpus + 3 * num_gpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
             namespace=cluster.namespace, configure_logging=False)
    try:
        with contextlib.suppress(Exception):
            cluster.session_dir = ray._private.worker._global_node.get_session_dir_path()
        cluster.track()
        yield cluster
    finally:
        cluster.track()
        ray.shutdown()
        procs = []
        for pid, t in cluster.processes.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if abs(proc.create_time() - t) < 1e-3:
                    procs.append(proc)
        _, still = psutil.wait_procs(procs, timeout=shutdown_timeout_s)
        for proc in still:  # ours by pid and start time: end them
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, still = psutil.wait_procs(still, timeout=5)
        for proc in still:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        cluster.left_behind = [pid for pid, t in cluster.processes.items() if alive(pid, t)]
        if cluster.left_behind:
            logger.warning("Ray processes of the demo still alive after shutdown: %s", cluster.left_behind)
