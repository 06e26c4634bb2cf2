"""Shared set-up of the integration tests of AsyncRMAgentLoopManager: verl's real reward loop and agent loop."""

from __future__ import annotations

import contextlib

from conftest import CLUSTER_SHARED, empty_transfer_queue, transfer_queue

RULE = "tests/integration/assets/rule.py"
AGENT_LOOPS = "tests/integration/assets/agent_loops.yaml"
RM_W, RULE_W = 2.0, 0.5


#: The override that gives the main RM two replicas (the tests' default is one).
TWO_REPLICAS = "reward.reward_model.n_gpus_per_node=2"


def overrides(tiny_models, *extra, rm_path=None):
    """The recipe overrides a user adds, plus test settings (one CPU replica, a rule, custom agent loops); an ``extra``
    override of a key set here replaces it (:data:`TWO_REPLICAS` where a test is about several: each replica is a
    process that imports verl and loads the RM, seconds of a 2-core machine)."""
    base = [
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager",
        "reward.reward_model.enable_resource_pool=True",
        "reward.reward_model.n_gpus_per_node=1",
        "reward.reward_model.nnodes=1",
        f"reward.reward_model.model_path={rm_path or tiny_models.rm}",
        "reward.reward_manager.name=async_rm",
        f"reward.custom_reward_function.path={RULE}",
        f"+async_rm.rm_weight={RM_W}",
        f"+async_rm.rule_weight={RULE_W}",
        "+async_rm.max_wait_ms=50",
        "+async_rm.placement_timeout_s=60",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOPS}",
    ]
    replaced = {_key(o) for o in extra}
    return [o for o in base if _key(o) not in replaced] + list(extra)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def generation(ray, tiny_models, server_kwargs=None):
    """``(servers, load balancer)``: the synthetic generation server with ``server_kwargs`` (for example ``steps=3``)
    and verl's load balancer over it, started once per session cluster and reused by every manager of that cluster
    (each is a process that imports verl: seconds of a 2-core machine per manager start). Reset here, so that the
    responses a test gets do not depend on the tests before it."""
    from verl_async_rm.testing import LengthDistribution, start_generation_servers, start_load_balancer

    kwargs = {"model_path": str(tiny_models.policy), "response_length": 24,
              "lengths": LengthDistribution(median_tokens=8, sigma=1.0), **(server_kwargs or {})}
    key = ("generation", repr(sorted(kwargs.items())))
    if key not in CLUSTER_SHARED:
        servers = start_generation_servers(1, name_prefix=f"gen{len(CLUSTER_SHARED)}", **kwargs)
        CLUSTER_SHARED[key] = servers, start_load_balancer(servers)
    servers, balancer = CLUSTER_SHARED[key]
    ray.get([server.reset.remote() for server in servers.values()], timeout=60)
    return servers, balancer


@contextlib.contextmanager
def running_manager(ray, tiny_models, trainer: str, *extra: str, rm_path=None, server_kwargs=None, num_workers=1):
    """Build the manager as verl's trainer does (after verl's RewardLoopManager), on the cluster's shared generation
    server (:func:`generation`); yield (manager, config); tear down.

    ``extra`` overrides are added to :func:`overrides`; ``rm_path`` replaces the tiny RM; ``server_kwargs`` go to the
    synthetic generation server (for example ``steps=3``); ``num_workers``: agent-loop and reward-loop workers (one
    unless the module is about several: each is a process that imports verl, seconds of a 2-core machine).
    """
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.workers.rollout.llm_server import LLMServerClient

    from verl_async_rm import AsyncRMAgentLoopManager
    from verl_async_rm.testing import compose_trainer_config

    config = compose_trainer_config(tiny_models.policy, trainer=trainer, rollout_n=2, response_length=24,
                                    num_workers=num_workers, overrides=overrides(tiny_models, *extra, rm_path=rm_path))
    if trainer == "v1":
        transfer_queue(config)  # the cluster's, emptied
    _, balancer = generation(ray, tiny_models, server_kwargs)
    reward_loop = RewardLoopManager(config=config, rm_resource_pool=None)
    try:
        manager = AsyncRMAgentLoopManager.create(
            config=config, llm_client=LLMServerClient(config=config, load_balancer_handle=balancer),
            teacher_client=None, reward_loop_worker_handles=reward_loop.reward_loop_worker_handles,
        )
    except BaseException:  # e.g. a start that must fail: leave nothing running
        for worker in reward_loop.reward_loop_workers:
            ray.kill(worker)
        raise
    try:
        yield manager, config
    finally:
        manager.shutdown()
        for worker in reward_loop.reward_loop_workers + manager.agent_loop_workers:
            ray.kill(worker)
        if trainer == "v1":
            empty_transfer_queue()


def replicas_of(manager, wait_s: float = 180.0) -> list:
    """The RM replicas the manager's service runs now, found by the actor names its ``describe()`` reports; waits
    (bounded) for replacements still loading, which cannot answer yet."""
    import time

    import ray

    deadline = time.monotonic() + wait_s
    while True:
        infos = ray.get(manager.rm_service.describe.remote(), timeout=60)
        if all("actor_name" in info for info in infos) or time.monotonic() > deadline:
            return [ray.get_actor(info["actor_name"]) for info in infos]
        time.sleep(0.2)


def prompts_batch(n_prompts: int, rollout_n: int, agent_names=None):
    """A v0 prompt batch: each question repeated ``rollout_n`` times, as verl's v0 trainer sends it."""
    import numpy as np
    from verl import DataProto

    questions = [f"how many apples are left after step {i}?" for i in range(n_prompts)]
    rows = [q for q in questions for _ in range(rollout_n)]  # v0 repeats each prompt rollout_n times
    return DataProto(
        batch=None,
        non_tensor_batch={
            "raw_prompt": np.array([[{"role": "user", "content": q}] for q in rows], dtype=object),
            "data_source": np.array(["tiny"] * len(rows), dtype=object),
            "reward_model": np.array([{"ground_truth": "42"} for _ in rows], dtype=object),
            "uid": np.array([f"u{i // rollout_n}" for i in range(len(rows))], dtype=object),
            "index": np.array([i // rollout_n for i in range(len(rows))]),
            **({"agent_name": np.array(agent_names, dtype=object)} if agent_names is not None else {}),
        },
        meta_info={"global_steps": 1, "validate": False},
    )


def wait_until_busy(service, wait_s: float = 120.0) -> None:
    """Wait (bounded) until an RM service holds work of the step: a request queued or running on a replica."""
    import time

    import ray

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        stats = ray.get(service.stats.remote(), timeout=30)
        if stats["submitted"] > 0 and (stats["in_flight_requests"] or stats["queue_len"]):
            return
        time.sleep(0.01)


def direct_scores(batch, rm_path, policy_path):
    """(RM score, rule score) of each sampled v1 trajectory (a ``V1Batch``), computed with plain transformers and the
    tests' rule (``assets/rule.py``: response length mod 7, over 7)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(policy_path)
    out = []
    for i in range(len(batch.keys)):
        prompt, response = batch.data["prompts"][i], batch.data["responses"][i]
        with torch.no_grad():
            ids = torch.cat([prompt, response]).unsqueeze(0)
            direct = float(rm.score(rm.model(input_ids=ids).last_hidden_state)[0, -1, 0])
        out.append((direct, (len(tok.decode(response, skip_special_tokens=True)) % 7) / 7.0))
    return out
