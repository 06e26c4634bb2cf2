"""The plugin on verl's real vLLM rollout, and verl's own vLLM-served RM on the same trajectories (vLLM's CPU build).

One module-scoped Ray cluster with logical GPUs (verl's vLLM pools ask for them) holds one verl ``vLLMReplica`` of the
tiny policy (started once: about 30 s) and, for the comparison, one engine of verl's served RM. The plugin's manager
runs one step twice on that rollout: with its replicas on transformers, then on vLLM (``+async_rm.engine=vllm``). The
rollout uses the
demo's agent loop (a log-normal length per trajectory, ``ignore_eos``, greedy, ordinary tokens), so every response
length is known in advance.

These tests skip with the reason where vLLM cannot run; ``VERL_ASYNC_RM_REQUIRE_VLLM=1`` (set by ``.ci/run``) turns
that skip into a failure, so CI never passes without them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from manager_cases import RM_W, RULE_W, overrides

pytestmark = pytest.mark.integration

MEDIAN, SIGMA, SEED, RESPONSE_LENGTH = 12.0, 0.8, 3, 32
QUESTIONS = ["how many apples are left?", "what is the total cost?", "what is its speed?", "how many eggs?"]
N = 2  # rollout.n


def _plugin_config(tiny_models, tmp_path_factory, *extra):
    from verl_async_rm.demo.agent_loop import AGENT_NAME, write_agent_loop_config
    from verl_async_rm.testing import compose_trainer_config
    from verl_async_rm.testing.vllm_rollout import cpu_rollout_overrides

    loops = write_agent_loop_config(tmp_path_factory.mktemp("loops") / "agent_loops.yaml", median_tokens=MEDIAN,
                                    sigma=SIGMA, seed=SEED)
    extra = [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
             f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
             "+async_rm.retemplate=always", *cpu_rollout_overrides(256), *extra]
    return compose_trainer_config(tiny_models.policy, trainer="v1", rollout_n=N, response_length=RESPONSE_LENGTH,
                                  overrides=overrides(tiny_models, *extra))


def _one_step(config, client):
    """One v1 step of a plugin manager built as verl's trainer builds it: the batch in prompt order, with the
    replicas' ``describe()``."""
    import ray
    from verl.experimental.reward_loop import RewardLoopManager

    from verl_async_rm import AsyncRMAgentLoopManager
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    reward_loop = RewardLoopManager(config=config, rm_resource_pool=None)
    manager = AsyncRMAgentLoopManager.create(config=config, llm_client=client, teacher_client=None,
                                             reward_loop_worker_handles=reward_loop.reward_loop_worker_handles)
    try:
        loop = V1FitLoop(config, manager)
        fields = ("uid", "rm_scores", "extra_fields", "prompts", "responses")
        prompts = prompt_batch(QUESTIONS)
        batch = loop.train_step(prompts, fields=fields)
        batch.questions = dict(zip(list(prompts["uid"]), QUESTIONS, strict=True))  # uid -> question
        batch.described = ray.get(manager.rm_service.describe.remote(), timeout=120)
        return batch
    finally:
        manager.shutdown()
        for actor in [*reward_loop.reward_loop_workers, *manager.agent_loop_workers]:
            ray.kill(actor)


@pytest.fixture(scope="module")
def rollout(vllm_ray, tiny_models, tmp_path_factory):
    """verl's vLLM rollout replica of the tiny policy (started once for the module) and its client."""
    import transfer_queue as tq

    from verl_async_rm.testing.vllm_rollout import start_vllm_rollout, stop_vllm_rollout

    config = _plugin_config(tiny_models, tmp_path_factory)
    tq.init(config.transfer_queue)
    replica, client = start_vllm_rollout(config)
    try:
        yield client
    finally:
        stop_vllm_rollout(replica)  # its placement group too: the cluster's next module needs the GPU
        tq.close()


@pytest.fixture(scope="module")
def plugin_step(rollout, tiny_models, tmp_path_factory):
    """One v1 step of the plugin's manager (transformers replicas) on verl's real vLLM rollout."""
    return _one_step(_plugin_config(tiny_models, tmp_path_factory), rollout)


@pytest.fixture(scope="module")
def vllm_engine_step(rollout, tiny_models, tmp_path_factory):
    """The same step with ``+async_rm.engine=vllm``: the plugin's replicas score on vLLM's pooling engine."""
    return _one_step(_plugin_config(tiny_models, tmp_path_factory, "+async_rm.engine=vllm"), rollout)


def _raw_prompt(batch, i):
    """The trajectory's prompt messages (its key is ``{uid}_{session}_{index}``)."""
    return [{"role": "user", "content": batch.questions[str(batch.keys[i]).split("_")[0]]}]


def _rm_reference(rm_path, policy_path, raw_prompt, response_ids):
    """Plain transformers: the RM's forward on its own chat template of the prompt and the decoded response (fp32)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy_tok, rm_tok = AutoTokenizer.from_pretrained(policy_path), AutoTokenizer.from_pretrained(rm_path)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    text = rm_tok.apply_chat_template(
        [*raw_prompt, {"role": "assistant", "content": policy_tok.decode(response_ids)}], tokenize=False)
    ids = rm_tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(rm(input_ids=torch.tensor([ids])).logits[0, 0])


def _assert_every_trajectory_scored_exactly(batch, tiny_models):
    from transformers import AutoTokenizer

    from verl_async_rm.demo.agent_loop import response_tokens

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    assert len(batch.keys) == N * len(QUESTIONS)
    specials = set(tok.all_special_ids)
    for i in range(len(batch.keys)):
        raw = _raw_prompt(batch, i)
        response = batch.data["responses"][i].tolist()
        # verl's vLLM generated it: the demo agent loop's length exactly (ignore_eos), ordinary tokens only
        assert len(response) == response_tokens(raw, median_tokens=MEDIAN, sigma=SIGMA, seed=SEED,
                                                budget=RESPONSE_LENGTH)
        assert not specials & set(response)
        info = batch.reward_extra_info(i)
        expected_rm = _rm_reference(tiny_models.rm, tiny_models.policy, raw, response)
        expected_rule = (len(tok.decode(response, skip_special_tokens=True)) % 7) / 7.0
        assert float(info["rm_score"]) == pytest.approx(expected_rm, abs=1e-4)
        assert float(info["rule_score"]) == pytest.approx(expected_rule, abs=1e-6)
        assert batch.reward(i) == pytest.approx(RM_W * expected_rm + RULE_W * expected_rule, abs=1e-4)
    assert batch.metrics["async_rm/errors"] == 0
    assert len({len(batch.data["responses"][i]) for i in range(len(batch.keys))}) > 1  # lengths spread out


def test_the_plugin_scores_every_trajectory_of_verls_vllm_rollout_exactly(plugin_step, tiny_models):
    _assert_every_trajectory_scored_exactly(plugin_step, tiny_models)
    assert {info["engine"] for info in plugin_step.described} == {"hf"}


def test_with_engine_vllm_the_replicas_score_on_vllm_exactly_as_transformers(vllm_engine_step, tiny_models):
    _assert_every_trajectory_scored_exactly(vllm_engine_step, tiny_models)
    assert [info["engine"] for info in vllm_engine_step.described] == ["vllm"]  # one replica (manager_cases)


def test_verls_served_rm_scores_the_same_trajectories_as_the_plugin(plugin_step, tiny_models):
    """verl's own served RM (vLLM pooling, ``compute_score_disrm``) on each trajectory the plugin scored."""
    import ray
    from verl.protocol import DataProto

    from verl_async_rm.demo.served_rm import start_served_rm, stop_served_rm
    from verl_async_rm.testing import compose_trainer_config
    from verl_async_rm.testing.vllm_rollout import served_rm_overrides

    batch = plugin_step
    config = compose_trainer_config(tiny_models.policy, trainer="v1", num_workers=1,
                                    overrides=[*served_rm_overrides(str(tiny_models.rm), 1, max_model_len=512)])
    served = start_served_rm(config)
    try:
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
            assert float(batch.reward_extra_info(i)["rm_score"]) == pytest.approx(served_score, abs=1e-4), i
        assert len(ray.get(worker.pop_calls.remote(), timeout=60)) == len(batch.keys)
    finally:
        stop_served_rm(served)
