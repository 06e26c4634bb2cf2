"""What the plugin's v0 and v1 agent-loop managers share (:class:`AsyncRMManagerBase`): the RM services, one per RM,
launched while verl starts its agent-loop workers and handed to them; the step marks; the closing of a phase (its
metrics and ``on_error``); the sleep and wake of RMs on the policy's GPUs; a dead service's restart; the shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from typing import Any

import ray
from verl.utils.ray_utils import auto_await

from verl_async_rm.config import MAIN
from verl_async_rm.integration.checks import check_verl_config
from verl_async_rm.integration.drops import PhaseRecord, check_failures
from verl_async_rm.service.metrics import PREFIX, VAL_PREFIX, step_metrics
from verl_async_rm.service.placement import kill_and_wait, kill_quietly, remove_pool_groups
from verl_async_rm.service.service import launch_rm_services, start_rm_service, wait_rm_services

logger = logging.getLogger(__name__)

__all__ = ["AsyncRMManagerBase", "CONTROL_TIMEOUT_S"]

#: Longest a control call to the RM service or an agent-loop worker may take (attach, step marks, close).
CONTROL_TIMEOUT_S = 60.0


class AsyncRMManagerBase:
    """What the v0 and v1 managers share (module doc)."""


    def _async_rm_build(self, config: Any) -> None:
        self.async_rm_config = check_verl_config(config)
        self._async_rm_check(config)
        self.rm_services = {}
        self.last_metrics: dict[str, float] = {}
        self.service_restarts = 0
        base = f"verl_async_rm_{uuid.uuid4().hex[:8]}"
        self._service_names = {e.name: base if e.name == MAIN else f"{base}_{e.name}"
                               for e in self.async_rm_config.models}
        self._entries = {e.name: e for e in self.async_rm_config.models}
        self.last_val_metrics: dict[str, float] = {}
        self._on_policy_pool = any(e.rm.sleeps for e in self.async_rm_config.models)
        integration = self.async_rm_config.integration
        self._rm_launched = launch_rm_services(self.async_rm_config.models, self._service_names,
                                               replace_replicas=integration.replace_replicas,
                                               max_concurrency=integration.service_max_concurrency)
        self.rm_services = {name: service for name, (service, _) in self._rm_launched.items()}

    @property
    def rm_service(self) -> Any:
        """The main RM's service (``reward.reward_model.*``); None once shut down."""
        return self.rm_services.get(MAIN)

    def _async_rm_check(self, config: Any) -> None:
        """Checks of the trainer's settings that need ``async_rm_config``, before anything is started."""

    async def _init_agent_loop_workers(self):
        try:
            await super()._init_agent_loop_workers()
            # The RMs load while the workers start. The first call on each worker also waits for its construction
            # (tokenizer, tools...): allow the RM's load time, not the short control timeout.
            await asyncio.gather(self._async_rm_wait_loaded(),
                                 self._async_rm_attach(self.async_rm_config.rm.init_timeout_s))
        except BaseException:
            self.shutdown()
            for worker in getattr(self, "agent_loop_workers", []):
                kill_quietly(worker)
            raise

    async def _async_rm_wait_loaded(self) -> None:
        try:
            await asyncio.to_thread(wait_rm_services, self.async_rm_config.models, self._service_names,
                                    self._rm_launched)
        except BaseException:
            self.rm_services = {}  # stopped, their pools released
            raise

    async def _async_rm_attach(self, timeout_s: float) -> None:
        mix, integration = self.async_rm_config.mix, self.async_rm_config.integration
        await asyncio.wait_for(asyncio.gather(*(
            w.async_rm_attach.remote(self.rm_services, mix, integration.request_timeout_s, integration.on_error)
            for w in self.agent_loop_workers)), timeout_s)

    async def _async_rm_restart_service(self, name: str, cause: BaseException) -> None:
        """Replace a dead (or unresponsive) RM service by a new one (the RM loads again); hand it to the workers."""
        logger.error("verl_async_rm: the RM service of RM %r is gone (%r); starting a new one", name, cause)
        kill_quietly(self.rm_services[name])
        entry, integration = self._entries[name], self.async_rm_config.integration
        self.rm_services[name] = await asyncio.to_thread(
            start_rm_service, entry.rm, entry.batching, name=self._service_names[name],
            replace_replicas=integration.replace_replicas, max_concurrency=integration.service_max_concurrency)
        self.service_restarts += 1
        await self._async_rm_attach(CONTROL_TIMEOUT_S)

    async def _async_rm_control(self, method: str, *args: Any, timeout_s: float = CONTROL_TIMEOUT_S
                                ) -> dict[str, Any]:
        """A call to every RM service at a step boundary, by RM name; a dead (or silent past ``timeout_s``) service
        is replaced and asked again."""

        async def call(name: str) -> Any:
            try:
                return await asyncio.wait_for(getattr(self.rm_services[name], method).remote(*args), timeout_s)
            except (ray.exceptions.RayActorError, asyncio.TimeoutError) as err:
                await self._async_rm_restart_service(name, err)
            return await asyncio.wait_for(getattr(self.rm_services[name], method).remote(*args), timeout_s)

        names = list(self.rm_services)
        return dict(zip(names, await asyncio.gather(*(call(name) for name in names)), strict=True))

    @auto_await
    async def async_rm_close(self, phase: str, global_steps: int | None = None) -> dict[str, float]:
        """End a training step (``phase='train'``) or a validation pass (``'val'``): its metrics, from the workers'
        records and the services' metrics since the previous close, or its failure (``on_error``:
        :func:`~verl_async_rm.integration.drops.check_failures`)."""
        records = await asyncio.wait_for(
            asyncio.gather(*(w.async_rm_pop_record.remote(phase) for w in self.agent_loop_workers)),
            CONTROL_TIMEOUT_S)
        record = functools.reduce(PhaseRecord.merge, records, PhaseRecord())
        prefix = PREFIX if phase == "train" else VAL_PREFIX
        steps = await self._async_rm_control("end_step")
        # the main RM's metrics as async_rm/*, with the workers' trajectory counts (the services' include every phase)
        metrics = step_metrics(steps[MAIN], record, prefix=prefix)
        if len(steps) > 1:  # and each RM's as async_rm/<name>/*
            for name, step in steps.items():
                metrics.update(step_metrics(step, prefix=f"{prefix}{name}/"))
        metrics[prefix + "service_restarts_total"] = float(self.service_restarts)
        integration = self.async_rm_config.integration
        if integration.on_error == "drop":
            metrics[prefix + "dropped"] = float(record.failed)
        if phase == "train":
            self.last_metrics = metrics
        else:
            self.last_val_metrics = metrics
        where = f"step {global_steps}" if phase == "train" else f"the validation at step {global_steps}"
        check_failures(record, integration, where)
        return metrics

    @auto_await
    async def async_rm_sleep(self) -> None:
        """The policy is about to train: the RMs on the policy's GPUs release them (``placement='policy_pool'``;
        a no-op otherwise). v1: after the step's sampling (:mod:`.trainer_hooks`); v0: as a training batch returns."""
        if self._on_policy_pool:
            await self._async_rm_control("sleep", timeout_s=self._sleep_timeout_s())

    @auto_await
    async def async_rm_wake(self) -> None:
        """The next rollout is about to start: the RMs take the policy's GPUs back (see :meth:`async_rm_sleep`)."""
        if self._on_policy_pool:
            await self._async_rm_control("wake", timeout_s=self._sleep_timeout_s())

    def _sleep_timeout_s(self) -> float:
        """Longest a sleep or a wake of every RM may take: the running batches' end (``batch_timeout_s``), then each
        replica's move of its weights (``init_timeout_s``), and a minute for the calls."""
        return max((e.batching.batch_timeout_s or 60.0) + e.rm.init_timeout_s + CONTROL_TIMEOUT_S
                   for e in self._entries.values())

    def shutdown(self) -> None:
        """Close the RM services (waiting requests fail with BatcherClosedError; replicas and pools released)."""
        services, self.rm_services = dict(getattr(self, "rm_services", None) or {}), {}
        for name, service in services.items():
            try:
                ray.get(service.close.remote(), timeout=CONTROL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - shutting down: log and go on releasing
                logger.warning("verl_async_rm: the RM service of RM %r did not close cleanly: %r", name, exc)
                # its replicas go with it, but its placement groups live as long as the job
                remove_pool_groups(f"{self._service_names[name]}_", self._entries[name].rm.nnodes)
            kill_and_wait([service], CONTROL_TIMEOUT_S)  # gone on return (its replicas are owned by it)
