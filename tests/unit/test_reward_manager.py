"""The ``async_rm`` reward manager, built by verl's own ``load_reward_manager`` and run on hand-built ``DataProto``s.

Each ``DataProto`` has the layout verl's ``AgentLoopWorker._compute_score`` sends to the reward loop
(``experimental/agent_loop/agent_loop.py:1000-1016``): prompt/response tensors, an attention mask over both, and the
trajectory's dataset fields in ``non_tensor_batch`` (here with the RM score the plugin's worker adds).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_async_rm.errors import NonFiniteScoreError, RewardModelError
from verl_async_rm.integration.reward_mix import RM_SCORE_KEY
from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit

ASSETS = Path(__file__).parent / "assets"
RULES = ASSETS / "rules.py"
RESPONSE = "the answer is 4"


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(tiny_models.policy), trust_remote_code=True)  # as verl's RewardLoopWorker loads it


def make_config(models, *overrides: str):
    return compose_trainer_config(
        models.policy,
        overrides=[
            "reward.reward_model.enable_resource_pool=True",
            "reward.reward_model.n_gpus_per_node=1",
            "reward.reward_model.nnodes=1",
            f"reward.reward_model.model_path={models.rm}",
            "reward.reward_manager.name=async_rm",
            *overrides,
        ],
    )


def load_manager(config, tokenizer):
    """Exactly what verl's ``RewardLoopWorker._init_reward_fn`` does (no reward-model servers)."""
    from verl.trainer.ppo.reward import load_reward_manager

    return load_reward_manager(config, tokenizer, reward_router_address=None, reward_model_tokenizer=None)


def make_data(tokenizer, response: str = RESPONSE, *, rm_score=0.25, data_source="tiny/no_rule",
              ground_truth=RESPONSE, extra_info=None, left_pad: int = 2, right_pad: int = 3):
    """One trajectory as verl's agent loop hands it to the reward loop: padded prompt and response, mask, kwargs."""
    from verl import DataProto

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids = tokenizer.encode("What is 2 + 2?", add_special_tokens=False)
    response_ids = tokenizer.encode(response, add_special_tokens=False)
    prompts = torch.tensor([[pad] * left_pad + prompt_ids])
    responses = torch.tensor([response_ids + [pad] * right_pad])
    mask = torch.tensor([[0] * left_pad + [1] * len(prompt_ids) + [1] * len(response_ids) + [0] * right_pad])
    kwargs = {"data_source": data_source, "reward_model": {"ground_truth": ground_truth}, "uid": "u0"}
    if extra_info is not None:
        kwargs["extra_info"] = extra_info
    if rm_score is not None:
        kwargs[RM_SCORE_KEY] = rm_score
    non_tensors = {k: np.array([v]) for k, v in kwargs.items()}  # as verl builds them
    non_tensors["__num_turns__"] = np.array([2])
    non_tensors["tool_extra_fields"] = np.array([{}], dtype=object)
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask,
                 "input_ids": torch.cat([prompts, responses], dim=1)},
        non_tensors=non_tensors,
    )


def test_verl_resolves_async_rm_to_the_plugin_class(tiny_models):
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    from verl_async_rm.integration.reward_manager import AsyncRMRewardManager

    assert resolve_reward_manager_cls(make_config(tiny_models)) is AsyncRMRewardManager


@pytest.mark.asyncio
async def test_weighted_mix_with_verl_default_rule(tiny_models, tokenizer):
    config = make_config(tiny_models, "+async_rm.rm_weight=2", "+async_rm.rule_weight=0.5")
    manager = load_manager(config, tokenizer)
    # verl's default_compute_score knows gsm8k: "#### 4" against ground truth "4" scores 1.0
    out = await manager.run_single(make_data(tokenizer, "so #### 4", data_source="openai/gsm8k", ground_truth="4"))
    assert out["reward_score"] == pytest.approx(2 * 0.25 + 0.5 * 1.0)
    assert out["reward_extra_info"] == {"acc": 1.0, "rm_score": 0.25, "rule_score": 1.0}

    wrong = await manager.run_single(make_data(tokenizer, "so #### 5", data_source="openai/gsm8k", ground_truth="4"))
    assert wrong["reward_score"] == pytest.approx(2 * 0.25)
    assert wrong["reward_extra_info"]["rule_score"] == 0.0


@pytest.mark.asyncio
async def test_rule_weight_zero_skips_the_rule_for_any_data_source(tiny_models, tokenizer):
    manager = load_manager(make_config(tiny_models, "+async_rm.rule_weight=0"), tokenizer)
    out = await manager.run_single(make_data(tokenizer, rm_score=-1.5, data_source="no/rule/for/this"))
    assert out == {"reward_score": -1.5, "reward_extra_info": {"rm_score": -1.5, "rule_score": 0.0}}


@pytest.mark.asyncio
async def test_without_rule_weight_zero_an_unknown_data_source_fails_in_verl(tiny_models, tokenizer):
    manager = load_manager(make_config(tiny_models, "+async_rm.rule_weight=1"), tokenizer)
    with pytest.raises(NotImplementedError):
        await manager.run_single(make_data(tokenizer, data_source="no/rule/for/this"))


@pytest.mark.asyncio
async def test_custom_rule_gets_the_decoded_response_and_its_clashing_keys_are_prefixed(tiny_models, tokenizer):
    config = make_config(
        tiny_models,
        f"reward.custom_reward_function.path={RULES}",
        "reward.custom_reward_function.name=exact_match",
        "+async_rm.rule_weight=1",
    )
    manager = load_manager(config, tokenizer)
    out = await manager.run_single(make_data(tokenizer, RESPONSE, rm_score=0.5, ground_truth=RESPONSE))
    # the rule saw exactly the response (padding cut by the attention mask, as in verl), so it matched
    assert out["reward_score"] == pytest.approx(0.5 + 1.0)
    assert out["reward_extra_info"] == {
        "score": 1.0,
        "response_chars": float(len(RESPONSE)),
        "rule/rm_score": -1.0,
        "rule/rule_score": -2.0,
        "rm_score": 0.5,
        "rule_score": 1.0,
    }


@pytest.mark.asyncio
async def test_combine_fn_replaces_the_weighted_sum(tiny_models, tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))
    config = make_config(
        tiny_models,
        f"reward.custom_reward_function.path={RULES}",
        "reward.custom_reward_function.name=exact_match",
        "+async_rm.combine_fn=combine_fns:scaled",
        "+async_rm.rm_weight=100",
    )
    manager = load_manager(config, tokenizer)
    data = make_data(tokenizer, RESPONSE, rm_score=0.5, data_source="abcd", extra_info={"bonus": 0.25})
    out = await manager.run_single(data)
    assert out["reward_score"] == pytest.approx(10 * 0.5 + 1.0 + len("abcd") + 0.25)
    assert (out["reward_extra_info"]["rm_score"], out["reward_extra_info"]["rule_score"]) == (0.5, 1.0)


@pytest.mark.asyncio
async def test_a_combine_fn_that_does_not_import_fails_when_the_manager_is_built(tiny_models, tokenizer):
    config = make_config(tiny_models, "+async_rm.combine_fn=no_such_module_for_tests_xyz:fn")
    with pytest.raises(ValueError, match=r"async_rm\.combine_fn='no_such_module_for_tests_xyz:fn'"):
        load_manager(config, tokenizer)


@pytest.mark.asyncio
async def test_missing_rm_score_names_the_manager_class_to_use(tiny_models, tokenizer):
    manager = load_manager(make_config(tiny_models), tokenizer)
    with pytest.raises(RewardModelError, match=r"agent_loop_manager_class=verl_async_rm\.AsyncRMAgentLoopManager"):
        await manager.run_single(make_data(tokenizer, rm_score=None))


@pytest.mark.asyncio
@pytest.mark.parametrize("score", [math.nan, math.inf])
async def test_non_finite_rm_score_raises(tiny_models, tokenizer, score):
    manager = load_manager(make_config(tiny_models), tokenizer)
    with pytest.raises(NonFiniteScoreError, match="not finite"):
        await manager.run_single(make_data(tokenizer, rm_score=score))


@pytest.mark.asyncio
async def test_non_finite_rule_score_raises_instead_of_a_nan_reward(tiny_models, tokenizer):
    config = make_config(
        tiny_models,
        f"reward.custom_reward_function.path={RULES}",
        "reward.custom_reward_function.name=not_finite",
        "+async_rm.rule_weight=1",
    )
    manager = load_manager(config, tokenizer)
    with pytest.raises(ValueError, match=r"rule score of data_source='tiny/no_rule' is nan"):
        await manager.run_single(make_data(tokenizer))


@pytest.mark.asyncio
async def test_on_error_drop_flags_the_trajectory_with_the_same_keys_as_a_scored_one(tiny_models, tokenizer):
    from verl_async_rm.integration.reward_mix import RM_ERROR_KEY

    manager = load_manager(make_config(tiny_models, "+async_rm.on_error=drop", "+async_rm.rule_weight=0.5",
                                       "+async_rm.rm_weight=2.0", f"reward.custom_reward_function.path={RULES}",
                                       "reward.custom_reward_function.name=exact_match"),
                           tokenizer)
    scored = await manager.run_single(make_data(tokenizer, rm_score=1.0))
    failed = make_data(tokenizer, rm_score=None)
    failed.non_tensor_batch[RM_ERROR_KEY] = np.array(["NonFiniteScoreError: the RM returned nan"], dtype=object)
    failed.non_tensor_batch[RM_SCORE_KEY] = np.array([None], dtype=object)
    dropped = await manager.run_single(failed)
    assert set(dropped["reward_extra_info"]) == set(scored["reward_extra_info"])  # verl stacks them
    assert scored["reward_extra_info"]["rm_dropped"] == 0.0 and scored["reward_extra_info"]["rm_error"] == ""
    assert dropped["reward_extra_info"]["rm_dropped"] == 1.0
    assert "NonFiniteScoreError" in dropped["reward_extra_info"]["rm_error"]
    # NaN, never a stand-in number: the v0 manager replaces it by the group mean and masks the row (apply_drops)
    assert math.isnan(dropped["reward_score"]) and math.isnan(dropped["reward_extra_info"]["rm_score"])
    assert dropped["reward_extra_info"]["rule_score"] == scored["reward_extra_info"]["rule_score"]


@pytest.mark.asyncio
async def test_an_rm_error_without_on_error_drop_is_refused(tiny_models, tokenizer):
    from verl_async_rm.integration.reward_mix import RM_ERROR_KEY

    manager = load_manager(make_config(tiny_models, "+async_rm.rule_weight=0"), tokenizer)
    failed = make_data(tokenizer, rm_score=None)
    failed.non_tensor_batch[RM_ERROR_KEY] = np.array(["boom"], dtype=object)
    with pytest.raises(RewardModelError, match="found no RM score"):
        await manager.run_single(failed)
