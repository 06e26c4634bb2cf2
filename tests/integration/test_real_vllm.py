"""verl's own vLLM-served RM, and the plugin's remote outcome RM at verl's served vLLM server, on the same trajectories
as the plugin's transformers replicas.

One manager step of verl's v1 agent loop (the stubbed fit loop, :class:`~verl_async_rm.testing.v1.V1FitLoop`, on the
cluster's synthetic generation server) scores every trajectory with the main RM on transformers, re-rendering the
trajectory with the RM's own chat template (``retemplate=always``). Then one engine of verl's served RM
(``compute_score_disrm``) scores the same trajectories, and the plugin's remote outcome RM (``endpoint``) scores them at
that engine's vLLM server. The cluster has logical GPUs because verl's served RM asks for one. The plugin's replicas on
vLLM (``engine=vllm``): through the manager ``test_tp_replicas.py``, against transformers ``test_vllm_engine.py``. The
plugin on verl's real vLLM rollout, every reward exact: ``test_manager_v1.py`` (in-process) and ``test_demo.py``
(``main_ppo``).

These tests skip with the reason where vLLM cannot run; ``VERL_ASYNC_RM_REQUIRE_VLLM=1`` (set by ``.ci/run``) turns
that skip into a failure, so CI never passes without them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from manager_cases import RM_W, RULE_W, running_manager
from rm_cases import remote_scores
from trainer_cases import rm_reference

pytestmark = pytest.mark.integration

QUESTIONS = ["how many apples are left?", "what is the total cost?", "what is its speed?", "how many eggs?"]
N = 2  # rollout.n (manager_cases)


@pytest.fixture(scope="module")
def step(vllm_ray, tiny_models):
    """One v1 step, the main RM on transformers."""
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    with running_manager(vllm_ray, tiny_models, "v1", "+async_rm.retemplate=always") as (manager, config):
        prompts = prompt_batch(QUESTIONS)
        batch = V1FitLoop(config, manager).train_step(prompts)
        batch.questions = dict(zip(list(prompts["uid"]), QUESTIONS, strict=True))  # uid -> question
    return batch


def _raw_prompt(batch, i):
    """The trajectory's prompt messages (its key is ``{uid}_{session}_{index}``)."""
    return [{"role": "user", "content": batch.questions[str(batch.keys[i]).split("_")[0]]}]


def test_the_plugin_scores_every_trajectory_as_transformers(step, tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    rm = rm_reference(tiny_models.rm, tiny_models.policy)
    assert len(step.keys) == N * len(QUESTIONS)
    for i in range(len(step.keys)):
        response = step.data["responses"][i].tolist()
        info = step.reward_extra_info(i)
        expected_rm = rm(_raw_prompt(step, i), response)
        expected_rule = (len(tok.decode(response, skip_special_tokens=True)) % 7) / 7.0
        assert float(info["rm_score_main"]) == pytest.approx(expected_rm, abs=1e-4)
        assert float(info["rule_score"]) == pytest.approx(expected_rule, abs=1e-6)
        assert step.reward(i) == pytest.approx(RM_W * expected_rm + RULE_W * expected_rule, abs=1e-4)
    assert step.metrics["async_rm/errors"] == 0 and step.metrics["async_rm/scored"] == len(step.keys)
    assert len({round(float(step.reward_extra_info(i)["rm_score_main"]), 4) for i in range(len(step.keys))}) > 1


@pytest.fixture(scope="module")
def served(step, tiny_models):
    """verl's own served RM (one vLLM pooling engine behind verl's reward router) of the tiny RM."""
    from verl_async_rm.demo.served_rm import start_served_rm, stop_served_rm
    from verl_async_rm.testing import compose_trainer_config
    from verl_async_rm.testing.vllm_rollout import served_rm_overrides

    config = compose_trainer_config(tiny_models.policy, trainer="v1", num_workers=1,
                                    overrides=[*served_rm_overrides(str(tiny_models.rm), 1, max_model_len=512)])
    manager = start_served_rm(config)
    try:
        yield manager
    finally:
        stop_served_rm(manager)


def test_verls_served_rm_scores_the_same_trajectories_as_the_plugin(step, served):
    """verl's own served RM (vLLM pooling, ``compute_score_disrm``) on each trajectory the plugin scored."""
    import ray
    from verl.protocol import DataProto

    batch = step
    worker = served.reward_loop_workers[0]
    for i in range(len(batch.keys)):
        prompt, response = batch.data["prompts"][i], batch.data["responses"][i]
        raw = np.empty(1, dtype=object)
        raw[0] = _raw_prompt(batch, i)
        data = DataProto.from_dict(
            tensors={"prompts": prompt[None], "responses": response[None],
                     "input_ids": torch.cat([prompt, response])[None],
                     "attention_mask": torch.ones(1, len(prompt) + len(response), dtype=torch.long)},
            non_tensors={"raw_prompt": raw, "data_source": np.array(["tiny"], dtype=object),
                         "reward_model": np.array([{"ground_truth": "42"}], dtype=object)})
        served_score = ray.get(worker.compute_score.remote(data), timeout=120)["reward_score"]
        assert float(batch.reward_extra_info(i)["rm_score_main"]) == pytest.approx(served_score, abs=1e-4), i
    assert len(ray.get(worker.pop_calls.remote(), timeout=60)) == len(batch.keys)


def test_the_plugins_remote_rm_at_verls_served_vllm_server_scores_as_the_plugin(step, served, tiny_models):
    """The plugin's remote outcome RM (``endpoint``: vLLM's ``/classify``, the start-up check's ``/v1/models``)
    pointed at the vLLM server of verl's served RM (vLLM's own OpenAI-compatible app): each trajectory's score
    equals the transformers replicas' (the same re-rendering, ``retemplate=always``)."""
    from verl_async_rm.request import RMRequest
    from verl_async_rm.scoring.rm_config import RMConfig

    batch = step
    [address] = served.reward_model_manager.server_addresses
    config = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      retemplate="always", endpoint=f"http://{address}/v1")
    requests = [RMRequest(uid=f"t{i}", raw_prompt=_raw_prompt(batch, i), prompt_ids=batch.data["prompts"][i].tolist(),
                          response_ids=batch.data["responses"][i].tolist()) for i in range(len(batch.keys))]

    remote, figures = remote_scores(config, requests)
    plugin = [float(batch.reward_extra_info(i)["rm_score_main"]) for i in range(len(batch.keys))]
    assert remote == pytest.approx(plugin, abs=1e-3)
    assert figures["scored"] == len(requests) and figures["errors"] == 0
