"""verl's own vLLM-served RM, and the plugin's remote outcome RM at verl's served vLLM server, on the same trajectories
as the plugin's transformers scorer.

The plugin scores the trajectories (the tiny policy's chat prompts and written answers) with the main RM on
transformers, re-rendering each with the RM's own chat template (``retemplate=always``), in this process: the scorer
an RM replica runs (through the manager: every manager module). Then one engine of verl's served RM
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
from rm_cases import remote_scores
from trainer_cases import rm_reference

from verl_async_rm.request import RMRequest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("vllm_ray")]  # one cluster: verl's served RM

QUESTIONS = ["how many apples are left?", "what is the total cost?", "what is its speed?", "how many eggs?"]
ANSWERS = ["There are 7 apples left.", "It costs 12 dollars.", "About 40 miles an hour, I think.", "A dozen eggs"]


@pytest.fixture(scope="module")
def trajectories(tiny_models) -> list[RMRequest]:
    """Two answers to each question, each ending in the policy's EOS, as the policy's chat prompt and ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    out = []
    for q, question in enumerate(QUESTIONS):
        raw_prompt = [{"role": "user", "content": question}]
        prompt_ids = tok.apply_chat_template(raw_prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        for a in (q, (q + 1) % len(ANSWERS)):
            response_ids = [*tok(ANSWERS[a], add_special_tokens=False)["input_ids"], tok.eos_token_id]
            out.append(RMRequest(uid=f"q{q}/{a}", raw_prompt=raw_prompt, prompt_ids=list(prompt_ids),
                                 response_ids=response_ids))
    return out


@pytest.fixture(scope="module")
def plugin(tiny_models, trajectories) -> list[float]:
    """The plugin's scores: its transformers scorer (an RM replica's), re-rendering every trajectory."""
    from verl_async_rm.scoring.rm_config import RMConfig
    from verl_async_rm.scoring.scorer import RewardModelScorer

    config = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      retemplate="always")
    return [float(score) for score in RewardModelScorer(config).score(trajectories)]


def test_the_plugin_scores_every_trajectory_as_transformers(plugin, trajectories, tiny_models):
    rm = rm_reference(tiny_models.rm, tiny_models.policy)
    assert plugin == pytest.approx([rm(t.raw_prompt, t.response_ids) for t in trajectories], abs=1e-4)
    assert len({round(score, 4) for score in plugin}) > 1  # the trajectories are told apart


@pytest.fixture(scope="module")
def served(vllm_ray, tiny_models):
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


def test_verls_served_rm_scores_the_same_trajectories_as_the_plugin(served, trajectories, plugin):
    """verl's own served RM (vLLM pooling, ``compute_score_disrm``) on each trajectory the plugin scored."""
    import ray
    from verl.protocol import DataProto

    worker = served.reward_loop_workers[0]
    for i, t in enumerate(trajectories):
        prompt, response = torch.tensor(t.prompt_ids), torch.tensor(t.response_ids)
        raw = np.empty(1, dtype=object)
        raw[0] = t.raw_prompt
        data = DataProto.from_dict(
            tensors={"prompts": prompt[None], "responses": response[None],
                     "input_ids": torch.cat([prompt, response])[None],
                     "attention_mask": torch.ones(1, len(prompt) + len(response), dtype=torch.long)},
            non_tensors={"raw_prompt": raw, "data_source": np.array(["tiny"], dtype=object),
                         "reward_model": np.array([{"ground_truth": "42"}], dtype=object)})
        served_score = ray.get(worker.compute_score.remote(data), timeout=120)["reward_score"]
        assert plugin[i] == pytest.approx(served_score, abs=1e-4), t.uid
    assert len(ray.get(worker.pop_calls.remote(), timeout=60)) == len(trajectories)


def test_the_plugins_remote_rm_at_verls_served_vllm_server_scores_as_the_plugin(served, trajectories, plugin,
                                                                                  tiny_models):
    """The plugin's remote outcome RM (``endpoint``: vLLM's ``/classify``, the start-up check's ``/v1/models``)
    pointed at the vLLM server of verl's served RM (vLLM's own OpenAI-compatible app): each trajectory's score
    equals the transformers scorer's (the same re-rendering, ``retemplate=always``)."""
    from verl_async_rm.scoring.rm_config import RMConfig

    [address] = served.reward_model_manager.server_addresses
    config = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      retemplate="always", endpoint=f"http://{address}/v1")
    remote, figures = remote_scores(config, trajectories)
    assert remote == pytest.approx(plugin, abs=1e-3)
    assert figures["scored"] == len(trajectories) and figures["errors"] == 0
