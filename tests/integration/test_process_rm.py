"""A process RM (Qwen2.5-Math-PRM style, token classification with two labels) on verl's v1 trainer, next to the RM
families users bring, and on v0.

The policy's responses have 3 steps (synthetic generation joins 3 parts with ``"\\n\\n"``). The reference follows the
public PRM card with plain transformers: the response split at ``"\\n\\n"``, the steps joined with ``<extra_0>`` and
ended with one, the conversation rendered with the PRM's chat template, softmax over the labels at each separator,
the probability of label 1. The same PRM runs twice: as ``main`` with ``process_reduction=none`` each step's probability
lands on the response token where that step ends (verl's ``rm_scores``); as ``outcome`` with ``min`` it adds one score
on the last token.

On v1 the two RM families that need keys of their own run in the same step, each as ``async_rm.models.<family>``
with its own pool and the keys a user sets for it: an InternLM2-Reward-style custom-code RM (``trust_remote_code``;
``AutoModel``, value head, reward token) and an ArmoRM-style custom-output RM (``score_output_field``). Every
trajectory's score from each equals what that RM's model card recipe gives in plain transformers (fp32, 1e-4) on the
same conversation, and the reward is the weighted sum of every RM. Every family, the five plain sequence-classification
ones too, is scored against its model card in process (``tests/unit/test_rm_families.py``): through the manager the
plain ones take the path of the tiny RM of every other module. (One manager for both: each RM is a set of processes
that import verl and load their RMs, seconds of a 2-core machine.)
"""

from __future__ import annotations

import pytest
import torch
from manager_cases import running_manager

pytestmark = pytest.mark.integration

N = 2  # rollout.n
PRM_W, MIN_W = 2.0, 0.5
#: The families with keys of their own (``family_settings``); the plain ones: ``tests/unit/test_rm_families.py``.
FAMILIES = ("internlm2", "armorm")
WEIGHTS = {name: 0.1 * (k + 1) for k, name in enumerate(FAMILIES)}
QUESTIONS = ["how many apples does the farmer have", "what is the total cost of two books"]


def prm_overrides(prm_path) -> list[str]:
    """``main``: the PRM with token-level step rewards; ``outcome``: the same PRM reduced to its minimum step (it
    takes the process keys from the top level)."""
    return [
        f"reward.reward_model.model_path={prm_path}", "reward.reward_model.n_gpus_per_node=1",
        "+async_rm.reward_kind=process", "+async_rm.step_separator='<extra_0>'", "+async_rm.process_reduction=none",
        f"+async_rm.rm_weight={PRM_W}", "+async_rm.rule_weight=0",
        f"+async_rm.models.outcome.model_path={prm_path}", f"+async_rm.models.outcome.weight={MIN_W}",
        "+async_rm.models.outcome.process_reduction=min",
    ]


@pytest.fixture(scope="module")
def families():
    from verl_async_rm.testing.families import build_family_models

    return build_family_models()


def reference(policy_tok, families, question: str, response_ids) -> tuple[list[float], list[int]]:
    """(step probabilities by the PRM card, the policy token where each step's text ends) for one response."""
    from verl_async_rm.testing.families import reference_step_probabilities

    ids = [int(t) for t in response_ids]
    while ids and ids[-1] in (policy_tok.eos_token_id, policy_tok.pad_token_id):
        ids.pop()
    text = policy_tok.decode(ids, skip_special_tokens=False)
    steps = [s for s in text.split("\n\n") if s.strip()]
    probabilities = reference_step_probabilities(families["prm"], [{"role": "user", "content": question}], steps)
    ends, offset = [], 0
    for step in steps:
        offset = text.index(step, offset) + len(step)
        ends.append(next(i for i in range(len(ids)) if len(policy_tok.decode(ids[: i + 1])) >= offset))
    return probabilities, ends


def family_overrides(families) -> list[str]:
    from verl_async_rm.testing.families import family_settings

    out = []
    for name in FAMILIES:  # outcome RMs: the main RM's kind (process) is every RM's default
        out += [f"+async_rm.models.{name}.model_path={families[name]}",
                f"+async_rm.models.{name}.weight={WEIGHTS[name]}", f"+async_rm.models.{name}.reward_kind=outcome"]
        out += [f"+async_rm.models.{name}.{key}={value}" for key, value in family_settings(name).items()]
    return out


def test_step_rewards_reach_verl_rm_scores_next_to_outcome_scores_of_custom_families(ray_wide, tiny_models, policy_tok,
                                                                                    families):
    from verl_async_rm.testing.families import reference_score
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    with running_manager(ray_wide, tiny_models, "v1", *prm_overrides(families["prm"]), *family_overrides(families),
                         server_kwargs={"steps": 3}) as (manager, config):
        assert set(manager.rm_services) == {"main", "outcome", *FAMILIES}
        prompts = prompt_batch(QUESTIONS)
        batch = V1FitLoop(config, manager).train_step(prompts)
    asked = dict(zip(prompts["uid"], QUESTIONS, strict=True))
    assert len(batch.keys) == len(QUESTIONS) * N
    for i in range(len(batch.keys)):
        response = batch.data["responses"][i]
        probabilities, ends = reference(policy_tok, families, asked[batch.data["uid"][i]], response)
        assert len(probabilities) == 3
        rm_scores, info, last = batch.data["rm_scores"][i], batch.reward_extra_info(i), len(response) - 1
        ids = [int(t) for t in response]
        while ids and ids[-1] in (policy_tok.eos_token_id, policy_tok.pad_token_id):
            ids.pop()
        conversation = [{"role": "user", "content": asked[batch.data["uid"][i]]},
                        {"role": "assistant", "content": policy_tok.decode(ids, skip_special_tokens=False)}]
        outcome = MIN_W * min(probabilities)  # the outcome RMs' part, on the last token
        for name in FAMILIES:
            expected = reference_score(name, families[name], conversation)
            assert info[f"rm_score_{name}"] == pytest.approx(expected, abs=1e-4), name
            outcome += WEIGHTS[name] * expected
        # 3 step rewards, each on the token where its step ends; the outcome RMs' part on the last token
        assert torch.nonzero(rm_scores).flatten().tolist() == [*ends, last]
        assert rm_scores[ends].tolist() == pytest.approx([PRM_W * p for p in probabilities], abs=1e-4)
        assert float(rm_scores[last]) == pytest.approx(outcome, abs=1e-3)
        assert info["rm_score"] == pytest.approx(sum(probabilities), abs=1e-4)
        assert info["rm_score_outcome"] == pytest.approx(min(probabilities), abs=1e-4)
        assert info["rm_total"] == pytest.approx(PRM_W * sum(probabilities) + outcome, abs=1e-3)
        assert batch.reward(i) == pytest.approx(PRM_W * sum(probabilities) + outcome, abs=1e-3)
    m = batch.metrics
    assert m["async_rm/scored"] == len(QUESTIONS) * N and m["async_rm/errors"] == 0
    assert m["async_rm/main/steps_dropped"] == 0 and m["async_rm/outcome/steps_dropped"] == 0
    for name in ("main", "outcome", *FAMILIES):
        assert m[f"async_rm/{name}/scored"] == len(QUESTIONS) * N and m[f"async_rm/{name}/errors"] == 0, name


def test_v0_places_the_same_step_rewards_in_its_rm_scores(ray_wide, tiny_models, policy_tok, families):
    from manager_cases import prompts_batch

    with running_manager(ray_wide, tiny_models, "v0", *prm_overrides(families["prm"]),
                         server_kwargs={"steps": 3}) as (manager, _):
        output = manager.generate_sequences(prompts_batch(2, rollout_n=N))
    prompt_len = output.batch["prompts"].shape[1]
    question = "how many apples are left after step {}?"
    for i in range(len(output)):
        length = int(output.batch["attention_mask"][i, prompt_len:].sum())
        response = output.batch["responses"][i][:length]
        probabilities, ends = reference(policy_tok, families, question.format(i // N), response)
        row = output.batch["rm_scores"][i]
        assert torch.nonzero(row).flatten().tolist() == [*ends, length - 1]
        assert row[ends].tolist() == pytest.approx([PRM_W * p for p in probabilities], abs=1e-4)
        assert float(row[length - 1]) == pytest.approx(MIN_W * min(probabilities), abs=1e-4)
    assert "rm_token_rewards" not in output.non_tensor_batch  # consumed by the manager
    assert output.meta_info["timing"]["async_rm/scored"] == 2 * N
