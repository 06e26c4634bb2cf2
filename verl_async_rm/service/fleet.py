"""Every RM of a run started together, one RM service each: all pools reserved, or one ``ValueError`` naming each
pool's keys and size and what the cluster has, with nothing started left running (verl reserves none of these pools).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from verl_async_rm.errors import ResourcePoolError, remote_cause
from verl_async_rm.config import RMEntry
from verl_async_rm.service.placement import kill_and_wait, remove_pool_groups, replica_bundle
from verl_async_rm.service.service import launch_rm_service, start_timeout_s

__all__ = ["start_rm_services", "check_pools_fit", "pools_text"]

#: Longest wait for a killed service to be gone before its placement groups are removed.
_STOP_WAIT_S = 30.0


def start_rm_services(
    entries: Sequence[RMEntry], names: Mapping[str, str], *, replace_replicas: bool, max_concurrency: int
) -> dict[str, Any]:
    """Start one RM service per entry (``names``: each one's service name), all at once, and wait until every RM is
    loaded: ``{rm name: handle}``. Raises ``ValueError`` when the pools do not fit (now, or within
    ``placement_timeout_s``), else what kept an RM from starting, noted with its name."""
    check_pools_fit(entries)
    launched = {
        e.name: launch_rm_service(e.rm, e.batching, name=names[e.name], replace_replicas=replace_replicas,
                                  max_concurrency=max_concurrency)
        for e in entries
    }
    deadline = time.monotonic() + max(start_timeout_s(e.rm) for e in entries)
    failure: BaseException | None = None
    for entry in entries:
        try:
            ray.get(launched[entry.name][1], timeout=max(1.0, deadline - time.monotonic()))
        except BaseException as err:  # noqa: BLE001 - every service is stopped, then the first failure raised
            failure = failure or _named(err, entry)
    if failure is None:
        return {name: service for name, (service, _) in launched.items()}
    for entry in entries:
        _stop(launched[entry.name][0], names[entry.name], entry.rm.nnodes)
    cause = remote_cause(failure)
    if isinstance(cause, ResourcePoolError):
        notes = "".join(f" ({note})" for note in getattr(failure, "__notes__", ()))
        raise ValueError(f"the RM pools could not be reserved: {pools_text(entries)}. The first failure{notes}: "
                         f"{cause}. Fix: {_FIX}") from failure
    raise failure


def check_pools_fit(entries: Sequence[RMEntry]) -> None:
    """Raise ``ValueError`` when the pools ask more, in total, than the cluster has free now."""
    need: dict[str, float] = {}
    for entry in entries:
        if entry.rm.placement == "policy_pool":  # in the bundles verl reserved for the policy
            continue
        for resource, amount in _bundle(entry).items():
            need[resource] = need.get(resource, 0.0) + amount * entry.rm.num_replicas
    free = ray.available_resources()
    short = {r: amount for r, amount in need.items() if free.get(r, 0.0) + 1e-9 < amount}
    if short:
        raise ValueError(
            f"the RM pools do not fit in the cluster: {pools_text(entries)}; together they need "
            f"{_amounts(need)}, and the cluster has {_amounts({r: free.get(r, 0.0) for r in need})} free "
            f"({_amounts({r: ray.cluster_resources().get(r, 0.0) for r in need})} in all). Fix: {_FIX}"
        )


def pools_text(entries: Sequence[RMEntry]) -> str:
    """Each pool by its keys and size, e.g. ``async_rm.models.safety.n_gpus_per_node=1 x nnodes=1 (1 GPU)``."""
    parts = []
    for e in entries:
        unit = "GPU" if e.rm.use_gpu else "CPU"
        n, k = e.rm.num_replicas, e.rm.gpus_per_replica
        shape = (f"{n} {unit} bundle{'s' if n > 1 else ''}" if k == 1 else
                 f"{n * k} {unit}s: {n} replica{'s' if n > 1 else ''} of "
                 f"{e.key if e.key.startswith('async_rm') else 'async_rm'}.gpus_per_replica={k}")
        parts.append(f"RM {e.name!r}: {e.key}.n_gpus_per_node={e.rm.n_gpus_per_node} x {e.key}.nnodes="
                     f"{e.rm.nnodes} ({shape})")
    return "; ".join(parts)


_FIX = ("make a pool smaller (its n_gpus_per_node / nnodes), score with fewer RMs (async_rm.models.*), or give the "
        "cluster more GPUs")


def _bundle(entry: RMEntry) -> dict[str, float]:
    """What one replica's bundle asks (as :meth:`RMResourcePool.bundle`)."""
    return replica_bundle(entry.rm.gpus_per_replica, entry.rm.use_gpu)


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())


def _stop(service: Any, name: str, nnodes: int) -> None:
    """Kill a service that may still be starting, wait (bounded) until it is gone, then remove its pool's placement
    groups (they outlive the actor that made them)."""
    kill_and_wait([service], _STOP_WAIT_S)  # its replicas are owned by it and go with it
    remove_pool_groups(f"{name}_", nnodes)


def _named(err: BaseException, entry: RMEntry) -> BaseException:
    err.add_note(f"while starting RM {entry.name!r} ({entry.key})")
    return err
