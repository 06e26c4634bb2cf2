"""verl's reward managers (the plugin's ``async_rm``, verl's ``naive`` and ``dapo``) with the plugin's reward mix.

Each manager is built by verl's own ``load_reward_manager`` and run on hand-built ``DataProto``s with the layout
verl's ``AgentLoopWorker._compute_score`` sends to the reward loop (``experimental/agent_loop/agent_loop.py:
1000-1016``): prompt/response tensors, an attention mask over both, and the trajectory's dataset fields in
``non_tensor_batch``, whose ``extra_info`` carries the RM scores as the plugin's worker adds them. The manager's
result then goes through ``RewardMix.finish``, as in the worker: what the reward of a trajectory is, for any manager.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_async_rm.errors import RewardModelError
from verl_async_rm.reward_mix import with_rm_scores
from verl_async_rm.config import AsyncRMConfig
from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit

ASSETS = Path(__file__).parent / "assets"
RULES = ASSETS / "rules.py"
RESPONSE = "the answer is 4"


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(tiny_models.policy), trust_remote_code=True)  # as verl's RewardLoopWorker loads it


def make_config(models, *overrides: str, manager: str = "async_rm"):
    return compose_trainer_config(
        models.policy,
        overrides=[
            "reward.reward_model.enable_resource_pool=True",
            "reward.reward_model.n_gpus_per_node=1",
            "reward.reward_model.nnodes=1",
            f"reward.reward_model.model_path={models.rm}",
            f"reward.reward_manager.name={manager}",
            *overrides,
        ],
    )


def load_manager(config, tokenizer):
    """Exactly what verl's ``RewardLoopWorker._init_reward_fn`` does (no reward-model servers)."""
    from verl.trainer.ppo.reward import load_reward_manager

    return load_reward_manager(config, tokenizer, reward_router_address=None, reward_model_tokenizer=None)


def make_data(tokenizer, response: str = RESPONSE, *, rm_scores=None, data_source="tiny/no_rule",
              ground_truth=RESPONSE, extra_info=None, left_pad: int = 2, right_pad: int = 3):
    """One trajectory as verl's agent loop hands it to the reward loop: padded prompt and response, mask, kwargs
    (``extra_info`` with the RM scores as the plugin's worker adds them; none when ``rm_scores`` is False)."""
    from verl import DataProto

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids = tokenizer.encode("What is 2 + 2?", add_special_tokens=False)
    response_ids = tokenizer.encode(response, add_special_tokens=False)
    prompts = torch.tensor([[pad] * left_pad + prompt_ids])
    responses = torch.tensor([response_ids + [pad] * right_pad])
    mask = torch.tensor([[0] * left_pad + [1] * len(prompt_ids) + [1] * len(response_ids) + [0] * right_pad])
    kwargs = {"data_source": data_source, "reward_model": {"ground_truth": ground_truth}, "uid": "u0"}
    if rm_scores is not False:
        kwargs["extra_info"] = with_rm_scores(extra_info, {"main": 0.25} if rm_scores is None else rm_scores)
    elif extra_info is not None:
        kwargs["extra_info"] = extra_info
    non_tensors = {k: np.array([v]) for k, v in kwargs.items()}  # as verl builds them
    non_tensors["__num_turns__"] = np.array([2])
    non_tensors["tool_extra_fields"] = np.array([{}], dtype=object)
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask,
                 "input_ids": torch.cat([prompts, responses], dim=1)},
        non_tensors=non_tensors,
    )


async def reward_of(config, tokenizer, data, rm_scores=None, *, error=None):
    """(reward, reward_extra_info) of one trajectory: verl's manager (only when the reward uses its rule), then the
    plugin's mix, as the worker does."""
    settings = AsyncRMConfig.from_verl(config)
    result = await load_manager(config, tokenizer).run_single(data) if settings.mix.uses_rule else {}
    item = data[0].non_tensor_batch
    return settings.mix.finish(
        result, {"main": 0.25} if rm_scores is None else rm_scores, data_source=item["data_source"],
        extra_info=item.get("extra_info"), fn=settings.mix.load_combine_fn(), error=error,
        flag_drops=settings.integration.on_error == "drop",
    )


def test_verl_resolves_async_rm_to_the_plugin_class(tiny_models):
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    from verl_async_rm.integration.reward_manager import AsyncRMRewardManager

    assert resolve_reward_manager_cls(make_config(tiny_models)) is AsyncRMRewardManager


@pytest.mark.asyncio
async def test_weighted_mix_with_verl_default_rule(tiny_models, tokenizer):
    config = make_config(tiny_models, "+async_rm.rm_weight=2", "+async_rm.rule_weight=0.5")
    # verl's default_compute_score knows gsm8k: "#### 4" against ground truth "4" scores 1.0
    reward, info = await reward_of(config, tokenizer,
                                   make_data(tokenizer, "so #### 4", data_source="openai/gsm8k", ground_truth="4"))
    assert reward == pytest.approx(2 * 0.25 + 0.5 * 1.0)
    assert info == {"acc": 1.0, "rm_score": 0.25, "rm_score_main": 0.25, "rm_total": 0.5, "rule_score": 1.0}

    wrong = make_data(tokenizer, "so #### 5", data_source="openai/gsm8k", ground_truth="4")
    reward, info = await reward_of(config, tokenizer, wrong)
    assert reward == pytest.approx(2 * 0.25) and info["rule_score"] == 0.0


@pytest.mark.asyncio
async def test_rule_weight_zero_skips_the_rule_for_any_data_source(tiny_models, tokenizer):
    """No rule in the reward: the manager is never run (the worker does not call verl's reward loop), so a data source
    without a rule works, and no rule_score is reported (there is none)."""
    config = make_config(tiny_models, "+async_rm.rule_weight=0")
    reward, info = await reward_of(config, tokenizer, make_data(tokenizer, data_source="no/rule/for/this"),
                                   {"main": -1.5})
    assert reward == -1.5
    assert info == {"rm_score": -1.5, "rm_score_main": -1.5, "rm_total": -1.5}


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
    reward, info = await reward_of(config, tokenizer, make_data(tokenizer, RESPONSE, ground_truth=RESPONSE),
                                   {"main": 0.5})
    # the rule saw exactly the response (padding cut by the attention mask, as in verl), so it matched
    assert reward == pytest.approx(0.5 + 1.0)
    assert info == {
        "score": 1.0,
        "response_chars": float(len(RESPONSE)),
        "rule/rm_score": -1.0,
        "rule/rule_score": -2.0,
        "rm_score": 0.5,
        "rm_score_main": 0.5,
        "rm_total": 0.5,
        "rule_score": 1.0,
    }


@pytest.mark.asyncio
async def test_verls_naive_manager_with_a_function_of_the_rm_score_gives_exactly_that_function(tiny_models, tokenizer):
    config = make_config(tiny_models, f"reward.custom_reward_function.path={RULES}",
                         "reward.custom_reward_function.name=from_rm_score", "+async_rm.rm_weight=0",
                         manager="naive")
    assert AsyncRMConfig.from_verl(config).mix.rule_weight == 1.0  # a user's own manager counts by default
    data = make_data(tokenizer, rm_scores={"main": 0.75}, extra_info={"dataset_key": 1})
    reward, info = await reward_of(config, tokenizer, data, {"main": 0.75})
    assert reward == 3.0 * 0.75 - 1.0  # exactly the function's value: nothing added
    assert info["acc"] == reward and info["rule_score"] == reward and info["rm_score"] == 0.75


@pytest.mark.asyncio
async def test_verls_dapo_manager_keeps_its_overlong_penalty_and_the_rm_is_added(tiny_models, tokenizer):
    long_response = " ".join(["the answer is 4"] * 6)
    n_tokens = len(tokenizer.encode(long_response, add_special_tokens=False))
    config = make_config(
        tiny_models, f"reward.custom_reward_function.path={RULES}", "reward.custom_reward_function.name=exact_match",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True", "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=True", f"+reward.reward_kwargs.max_resp_len={n_tokens}",
        "+async_rm.rm_weight=2", manager="dapo",
    )
    short, short_info = await reward_of(config, tokenizer, make_data(tokenizer, RESPONSE), {"main": 0.5})
    assert short == pytest.approx(1.0 + 2 * 0.5) and short_info["overlong_reward"] == 0
    long, long_info = await reward_of(config, tokenizer, make_data(tokenizer, long_response), {"main": 0.5})
    # dapo: expected length max_resp_len - 4; this response is 4 tokens over it: penalty -4/4 * 1.0
    assert long_info["overlong_reward"] == pytest.approx(-1.0) and long_info["overlong"]
    assert long_info["rule_score"] == pytest.approx(0.0 - 1.0)
    assert long == pytest.approx(-1.0 + 2 * 0.5)


@pytest.mark.asyncio
async def test_several_rms_are_weighted_and_reported_by_name(tiny_models, tokenizer):
    config = make_config(tiny_models, "+async_rm.rm_weight=2", "+async_rm.rule_weight=0.5",
                         f"reward.custom_reward_function.path={RULES}",
                         "reward.custom_reward_function.name=exact_match",
                         f"+async_rm.models.safety.model_path={tiny_models.rm_alt}",
                         "+async_rm.models.safety.weight=-3")
    scores = {"main": 0.5, "safety": 0.25}
    reward, info = await reward_of(config, tokenizer, make_data(tokenizer, rm_scores=scores), scores)
    assert reward == pytest.approx(2 * 0.5 - 3 * 0.25 + 0.5 * 1.0)
    assert info["rm_score"] == 0.5 and info["rm_score_main"] == 0.5 and info["rm_score_safety"] == 0.25
    assert info["rm_total"] == pytest.approx(2 * 0.5 - 3 * 0.25) and info["rule_score"] == 1.0


@pytest.mark.asyncio
async def test_a_missing_rm_score_never_becomes_a_reward(tiny_models, tokenizer):
    config = make_config(tiny_models, f"+async_rm.models.safety.model_path={tiny_models.rm_alt}")
    with pytest.raises(RewardModelError, match="safety"):  # an RM that did not score: no partial sum
        await reward_of(config, tokenizer, make_data(tokenizer), {"main": 0.5})
    # NaN/inf scores are refused where the score is made (RewardModelScorer: test_rm_scorer, test_bad_input)


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
    data = make_data(tokenizer, RESPONSE, data_source="abcd", extra_info={"bonus": 0.25})
    reward, info = await reward_of(config, tokenizer, data, {"main": 0.5})
    assert reward == pytest.approx(10 * 0.5 + 1.0 + len("abcd") + 0.25)
    assert (info["rm_score"], info["rule_score"]) == (0.5, 1.0)


@pytest.mark.asyncio
async def test_combine_fn_gets_every_rm_score_by_name(tiny_models, tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))
    config = make_config(tiny_models, f"+async_rm.models.safety.model_path={tiny_models.rm_alt}",
                         "+async_rm.combine_fn=combine_fns:by_name", f"reward.custom_reward_function.path={RULES}",
                         "reward.custom_reward_function.name=exact_match")
    safe = {"main": 0.5, "safety": 2.0}
    assert (await reward_of(config, tokenizer, make_data(tokenizer, rm_scores=safe), safe))[0] == 0.5
    unsafe = {"main": 0.5, "safety": -2.0}
    assert (await reward_of(config, tokenizer, make_data(tokenizer, rm_scores=unsafe), unsafe))[0] == -1.0
    # a combine_fn written for one RM would never see the other RMs' scores: refused
    scaled = make_config(tiny_models, f"+async_rm.models.safety.model_path={tiny_models.rm_alt}",
                         "+async_rm.combine_fn=combine_fns:scaled")
    with pytest.raises(ValueError, match=r"combine_fns:scaled' takes no rm_scores parameter.*\(safety\)"):
        AsyncRMConfig.from_verl(scaled).mix.load_combine_fn()


@pytest.mark.asyncio
async def test_missing_rm_score_names_the_manager_class_to_use(tiny_models, tokenizer):
    manager = load_manager(make_config(tiny_models), tokenizer)
    with pytest.raises(RewardModelError, match=r"agent_loop_manager_class=verl_async_rm\.AsyncRMAgentLoopManager"):
        await manager.run_single(make_data(tokenizer, rm_scores=False))


@pytest.mark.asyncio
async def test_non_finite_rule_score_raises_instead_of_a_nan_reward(tiny_models, tokenizer):
    config = make_config(
        tiny_models,
        f"reward.custom_reward_function.path={RULES}",
        "reward.custom_reward_function.name=not_finite",
        "+async_rm.rule_weight=1",
    )
    with pytest.raises(ValueError, match=r"reward manager's reward for data_source='tiny/no_rule' is nan"):
        await reward_of(config, tokenizer, make_data(tokenizer))


@pytest.mark.asyncio
async def test_on_error_drop_flags_the_trajectory_with_the_same_keys_as_a_scored_one(tiny_models, tokenizer):
    config = make_config(tiny_models, "+async_rm.on_error=drop", "+async_rm.rule_weight=0.5",
                         "+async_rm.rm_weight=2.0", f"reward.custom_reward_function.path={RULES}",
                         "reward.custom_reward_function.name=exact_match")
    scored, scored_info = await reward_of(config, tokenizer, make_data(tokenizer), {"main": 1.0})
    # the worker still runs the manager for a trajectory whose RM failed (NaN rm_score in its extra_info)
    failed = make_data(tokenizer, rm_scores={})
    dropped, dropped_info = await reward_of(config, tokenizer, failed, {},
                                            error="NonFiniteScoreError: the RM returned nan")
    assert set(dropped_info) == set(scored_info)  # verl stacks them
    assert scored_info["rm_dropped"] == 0.0 and scored_info["rm_error"] == ""
    assert dropped_info["rm_dropped"] == 1.0 and "NonFiniteScoreError" in dropped_info["rm_error"]
    # NaN, never a stand-in number: the v0 manager replaces it by the group mean and masks the row (apply_drops)
    assert math.isnan(dropped) and math.isnan(dropped_info["rm_score"]) and math.isnan(dropped_info["rm_total"])
    assert dropped_info["rule_score"] == scored_info["rule_score"]


@pytest.mark.asyncio
async def test_a_custom_manager_loaded_by_importlib_keeps_its_own_terms(tiny_models, tokenizer):
    config = make_config(tiny_models, "reward.reward_manager.source=importlib",
                         f"reward.reward_manager.module.path={ASSETS / 'custom_manager.py'}",
                         f"reward.custom_reward_function.path={RULES}",
                         "reward.custom_reward_function.name=exact_match", manager="BonusRewardManager")
    reward, info = await reward_of(config, tokenizer, make_data(tokenizer), {"main": 0.5})
    assert reward == pytest.approx((1.0 + 0.125) + 0.5)  # rule_weight 1.0 (a user's manager) and rm_weight 1.0
    assert info["bonus"] == 0.125 and info["rule_score"] == pytest.approx(1.125) and info["rm_total"] == 0.5
