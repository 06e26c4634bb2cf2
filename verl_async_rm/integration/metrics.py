"""The per-step ``async_rm/*`` metrics: the RM service's step figures, with the trajectory counts of the phase."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["step_metrics", "PREFIX", "VAL_PREFIX"]

PREFIX = "async_rm/"
#: Validation passes on the v1 trainer (verl names its own validation metrics ``val-core/``, ``val-aux/``).
VAL_PREFIX = "val-async_rm/"


def step_metrics(service_step: Mapping[str, float], trajectories: Any = None, prefix: str = PREFIX) -> dict[str, float]:
    """``{prefix + name: number}`` from :meth:`RMService.end_step`'s figures.

    ``trajectories`` (a :class:`~verl_async_rm.integration.ledger.PhaseRecord`, v1) gives ``requests``/``scored``/
    ``errors`` as the agent-loop workers counted them for one phase, instead of the service's counts over every phase.
    """
    values = dict(service_step)
    if trajectories is not None:
        values.update(requests=trajectories.requests, scored=trajectories.scored, errors=trajectories.failed)
    return {prefix + name: float(value) for name, value in values.items()}
