"""The other ranks of a sharded replica, owned by its rank 0 (the ``RMReplica`` the service calls) in its bundle.
Every batch goes to every rank; any rank failing makes rank 0 exit at once (collectives would hang): the service sees
a lost replica and replaces all ``k`` ranks."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.scorer import RewardModelScorer
from verl_async_rm.scoring.sharding import ShardGroup, host_store

logger = logging.getLogger(__name__)

__all__ = ["RankWorker", "Ranks", "end_replica"]

_T = TypeVar("_T")


class RankWorker:
    """Rank ``r >= 1`` of a sharded replica (a Ray actor owned by rank 0): its share of the RM, and the same calls."""

    def __init__(self, config: RMConfig) -> None:
        self.config = config
        self._scorer: Any = None

    def join(self, group: ShardGroup) -> dict[str, Any]:
        """Join rank 0's group and load this rank's share of the RM; returns where this rank runs."""
        self._scorer = RewardModelScorer(self.config, device=_own_device(self.config.use_gpu), shard=group)
        context = ray.get_runtime_context()
        return {"rank": group.rank, "pid": os.getpid(), "actor_name": context.get_actor_name(),
                "node_ip": ray.util.get_node_ip_address(), "device": str(self._scorer.device)}

    def follow(self, requests: list[RMRequest]) -> int:
        """Run this rank's part of rank 0's batch (the results are rank 0's); returns the number of requests."""
        self._scorer.score(requests)
        return len(requests)


class Ranks:
    """Rank 0's handle on ranks ``1..k-1`` of its replica, in rank 0's bundle ``placement`` (``(placement group,
    bundle index)``); rank ``r`` is named ``<name>:rank<r>``."""

    def __init__(self, config: RMConfig, placement: tuple[Any, int], name: str | None) -> None:
        pg, bundle = placement
        self.config = config
        self.world_size = config.gpus_per_replica
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        options: dict[str, Any] = {"scheduling_strategy": strategy, "max_restarts": 0}
        if config.use_gpu:
            from verl.plugin.platform import get_platform

            options.update(get_platform().ray_resource_options(1))
        else:
            options["num_cpus"] = 1
        self.workers = [ray.remote(RankWorker).options(**options, **({"name": f"{name}:rank{r}"} if name else {}))
                        .remote(config) for r in range(1, self.world_size)]
        self.infos: list[dict[str, Any]] = []
        self._store: Any = None  # the group's TCPStore, which rank 0 hosts for the group's whole life

    def start(self, load: Callable[[ShardGroup, Any], _T]) -> _T:
        """Form the group and load the RM on every rank (``load(group, store)``: rank 0's own scorer). Raises what rank
        0's load raised; another rank failing, or not loaded ``init_timeout_s`` after rank 0, ends this process."""
        timeout_s = self.config.init_timeout_s
        host, port, store = host_store(self.world_size, timeout_s)
        self._store = store
        refs = [w.join.remote(ShardGroup(r, self.world_size, host, port, timeout_s))
                for r, w in enumerate(self.workers, 1)]
        own = self.run_with(refs, lambda: load(ShardGroup(0, self.world_size, host, port, timeout_s), store),
                            timeout_s=timeout_s, what="loading the RM")
        self.infos = ray.get(refs)
        return own

    def run(self, requests: Sequence[RMRequest], own: Callable[[], _T]) -> _T:
        """Give every other rank ``requests``, run rank 0's ``own()`` (the same scoring), wait for them; rank 0's
        result. Exits this process if a rank dies, fails or does not finish (see the module's docstring)."""
        refs = [w.follow.remote(list(requests)) for w in self.workers]
        what = f"a batch of {len(requests)}"
        try:
            # the other ranks run the same forwards in step: they finish within moments of rank 0 (bounded as a load)
            return self.run_with(refs, own, timeout_s=self.config.init_timeout_s, what=what)
        except Exception as err:  # noqa: BLE001 - the scorer isolates bad rows; anything else breaks the replica
            end_replica(f"rank 0 of this sharded replica failed during {what}: {err!r}")

    def run_with(self, refs: list[Any], own: Callable[[], _T], *, timeout_s: float, what: str) -> _T:
        """``own()`` while the other ranks run ``refs``; exits this process the moment one of them fails."""
        done = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(refs, done, what), daemon=True, name="verl_async_rm-ranks")
        watcher.start()
        try:
            result = own()
        except BaseException:  # rank 0 failed on its own: the other ranks are no longer in step with it
            done.set()
            self.kill()
            raise
        done.set()
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            end_replica(f"{len(pending)} of the replica's other ranks had not finished {what} {timeout_s:g}s after "
                        "rank 0")
        for ref in ready:
            _check(ref, what)
        watcher.join(timeout=5.0)
        return result

    def kill(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(worker, no_restart=True)

    def _watch(self, refs: list[Any], done: threading.Event, what: str) -> None:
        pending = list(refs)
        while pending and not done.is_set():
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            for ref in ready:
                _check(ref, what)


def _own_device(use_gpu: bool) -> Any:
    """This rank's device: None (the scorer's default: the one GPU Ray made visible, or the CPU), unless Ray was told
    not to set ``CUDA_VISIBLE_DEVICES`` (``RAY_EXPERIMENTAL_NOSET_*``): then the GPU Ray assigned, by its index, as
    verl's ``Worker`` does for rank 0."""
    if not use_gpu:
        return None
    from verl.utils.device import get_device_name, get_resource_name, get_torch_device
    from verl.utils.ray_utils import ray_noset_visible_devices

    if not ray_noset_visible_devices():
        return None
    index = int(ray.get_runtime_context().get_accelerator_ids()[get_resource_name()][0])
    get_torch_device().set_device(index)
    return f"{get_device_name()}:{index}"


def _check(ref: Any, what: str) -> None:
    try:
        ray.get(ref, timeout=0)
    except Exception as err:  # noqa: BLE001 - any failure of another rank breaks the replica
        end_replica(f"another rank of this sharded replica failed during {what}: {err!r}")


def end_replica(why: str) -> NoReturn:
    """End this replica's process (rank 0, and so the ranks it owns): the service then counts the replica as lost,
    re-queues its batch and replaces it whole."""
    logger.error("%s; ending the replica so that it is replaced", why)
    logging.shutdown()
    os._exit(1)

