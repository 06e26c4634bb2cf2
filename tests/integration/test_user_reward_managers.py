"""The user's own verl reward manager with the plugin: verl's ``naive`` (v1 and v0) and ``dapo`` (v1), run by verl's
real reward loop on trajectories of verl's real agent loop, with the tiny RM scored by the plugin's RM service.

- ``naive`` with a reward function computed from ``extra_info["rm_score"]`` (``rm_weight=0``, ``rule_weight=1``):
  the trajectory's reward is exactly that function's value, and ``rm_score`` is the plain-transformers score;
- ``dapo`` with its overlong penalty: the penalty of each trajectory (from its response length) is still in the
  manager's reward, and the RM is added: ``reward = rule_weight * (rule + penalty) + rm_weight * rm``;
- the v1 ``naive`` manager counts its calls: with the rule in the reward verl's reward loop runs once per trajectory;
  the next step, with no rule (``rule_weight=0``), it is never called, so a trajectory makes two Ray calls (worker ->
  RM service -> replica).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from manager_cases import RM_W, RULE_W, prompts_batch, running_manager
from conftest import TEST_ASSETS


pytestmark = pytest.mark.integration

N = 2  # rollout.n
FROM_RM_SCORE = ["reward.custom_reward_function.name=from_rm_score", "+async_rm.rm_weight=0", "+async_rm.rule_weight=1"]
NAIVE = "reward.reward_manager.name=naive"
COUNTING = ["reward.reward_manager.source=importlib", "reward.reward_manager.name=CountingRewardManager",
            f"reward.reward_manager.module.path={TEST_ASSETS / 'counting_manager.py'}"]
DAPO_MAX_RESP, DAPO_BUFFER = 8, 4  # dapo penalises responses longer than 8 - 4 tokens: -(extra / 4) * 1.0


def _direct(rm_path, ids) -> float:
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(rm(input_ids=torch.as_tensor(ids).unsqueeze(0)).logits[0, 0])


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _rule(tok, response_ids) -> float:
    """tests/integration/assets/rule.py:compute_score of the decoded response."""
    return (len(tok.decode(response_ids, skip_special_tokens=True)) % 7) / 7.0


def test_v0_naive_manager_reward_is_exactly_the_users_function_of_the_rm_score(ray_wide, tiny_models):
    with running_manager(ray_wide, tiny_models, "v0", NAIVE, *FROM_RM_SCORE) as (manager, _):
        output = manager.generate_sequences(prompts_batch(2, rollout_n=N))
    prompt_len = output.batch["prompts"].shape[1]
    for i in range(len(output)):
        mask = output.batch["attention_mask"][i].bool()
        rm_score = float(output.non_tensor_batch["rm_score"][i])
        assert rm_score == pytest.approx(_direct(tiny_models.rm, output.batch["input_ids"][i][mask]), abs=1e-4)
        last = int(output.batch["attention_mask"][i, prompt_len:].sum()) - 1
        assert float(output.batch["rm_scores"][i][last]) == _float32(3.0 * rm_score - 1.0)  # exactly
    assert output.meta_info["timing"]["async_rm/scored"] == 2 * N


def test_v1_dapo_manager_keeps_its_overlong_penalty_and_the_rm_is_added(ray_wide, tiny_models):
    from transformers import AutoTokenizer

    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    dapo = ["reward.reward_manager.name=dapo", f"+reward.reward_kwargs.max_resp_len={DAPO_MAX_RESP}",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            f"+reward.reward_kwargs.overlong_buffer_cfg.len={DAPO_BUFFER}",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward.reward_kwargs.overlong_buffer_cfg.log=True"]
    with running_manager(ray_wide, tiny_models, "v1", *dapo) as (manager, config):
        batch = V1FitLoop(config, manager).train_step(prompt_batch([f"question {i}" for i in range(4)]))
    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    penalties = []
    for i in range(len(batch.keys)):
        info, response = batch.reward_extra_info(i), batch.data["responses"][i]
        penalty = min(-(len(response) - (DAPO_MAX_RESP - DAPO_BUFFER)) / DAPO_BUFFER, 0.0)
        penalties.append(penalty)
        direct = _direct(tiny_models.rm, torch.cat([batch.data["prompts"][i], response]))
        assert info["overlong_reward"] == pytest.approx(penalty) and bool(info["overlong"]) is (penalty < 0)
        assert info["rule_score"] == pytest.approx(_rule(tok, response) + penalty)
        assert info["rm_score"] == pytest.approx(direct, abs=1e-4)
        assert batch.reward(i) == pytest.approx(RULE_W * (_rule(tok, response) + penalty) + RM_W * direct, abs=1e-4)
    assert any(p < 0 for p in penalties), "no response was long enough to be penalised: the check proved nothing"


@pytest.fixture
def reward_loop_calls(ray_wide):
    @ray_wide.remote(num_cpus=0)
    class Calls:
        def __init__(self) -> None:
            self.count = 0

        def add(self) -> None:
            self.count += 1

        def get(self) -> int:
            return self.count

    calls = Calls.options(name="reward_loop_calls").remote()
    yield calls
    ray_wide.kill(calls)


def test_v1_naive_manager_reward_is_exactly_the_users_function_and_with_no_rule_it_is_never_called(
        ray_wide, tiny_models, reward_loop_calls):
    """verl's ``naive`` manager (counting its calls) with a reward function of ``extra_info["rm_score"]``
    (``rm_weight=0``, ``rule_weight=1``): each reward is exactly the function's value, and verl's reward loop runs
    once per trajectory. The next step, the same workers given the mix that ``+async_rm.rule_weight=0`` gives them
    (no rule; the main RM weighted): verl's reward loop is never called, so a trajectory makes two Ray calls, one to
    the RM service and one per batch to a replica (both counted by the service)."""
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    prompts = prompt_batch(["how many apples?", "what is the cost?"])
    with running_manager(ray_wide, tiny_models, "v1", *COUNTING, *FROM_RM_SCORE) as (manager, config):
        loop = V1FitLoop(config, manager)
        with_rule = loop.train_step(prompts)
        calls = ray_wide.get(reward_loop_calls.get.remote(), timeout=60)
        service_before = ray_wide.get(manager.rm_service.stats.remote(), timeout=60)
        no_rule = dataclasses.replace(manager.async_rm_config.mix, rm_weight=RM_W, rule_weight=0.0)
        assert not no_rule.uses_rule
        ray_wide.get([w.async_rm_attach.remote(manager.rm_services, no_rule,
                                                  manager.async_rm_config.integration.request_timeout_s)
                      for w in manager.agent_loop_workers], timeout=60)
        without_rule = loop.train_step(prompts)
        service = ray_wide.get(manager.rm_service.stats.remote(), timeout=60)
        calls_after = ray_wide.get(reward_loop_calls.get.remote(), timeout=60)

    trajectories = 2 * N
    assert calls == trajectories and calls_after == calls  # once per trajectory with the rule, never without
    for batch in (with_rule, without_rule):
        assert len(batch.keys) == trajectories and batch.metrics["async_rm/scored"] == trajectories
    for i in range(trajectories):
        info = with_rule.reward_extra_info(i)
        ids = torch.cat([with_rule.data["prompts"][i], with_rule.data["responses"][i]])
        assert info["rm_score"] == pytest.approx(_direct(tiny_models.rm, ids), abs=1e-4)
        value = 3.0 * info["rm_score"] - 1.0  # the user's function
        assert info["rule_score"] == value and info["rm_total"] == 0.0 and info["saw_rms"] == 1.0
        assert with_rule.reward(i) == _float32(value)  # exactly (verl keeps rewards as float32): nothing added
        info = without_rule.reward_extra_info(i)
        assert "rule_score" not in info
        assert without_rule.reward(i) == pytest.approx(RM_W * info["rm_score"], abs=1e-5)
    # one call of each trajectory to the RM service, one of each batch to a replica
    assert service["submitted"] - service_before["submitted"] == trajectories
    assert 1 <= service["batches"] - service_before["batches"] <= trajectories
