"""The RM families users bring, all at once, through the agent-loop manager on verl's v1 trainer.

Seven RMs run next to the tiny ``main`` RM, each as ``async_rm.models.<family>`` with its own pool and the keys a user
sets for it (``trust_remote_code``, ``score_output_field``): Llama 3.1, Gemma 2, Qwen2.5, Qwen3 and Mistral sequence
classification, an InternLM2-Reward-style custom-code RM and an ArmoRM-style custom-output RM. Every trajectory's
score from each equals what that RM's model card recipe gives in plain transformers (fp32, 1e-4) on the same
conversation, and the reward is the weighted sum.
"""

from __future__ import annotations

import pytest
import torch
from manager_cases import RM_W, RULE_W, running_manager
from rm_cases import direct_score, hf_model

pytestmark = pytest.mark.integration

N = 2  # rollout.n
FAMILIES = ("llama", "gemma2", "qwen2", "qwen3", "mistral", "internlm2", "armorm")
WEIGHTS = {name: 0.1 * (k + 1) for k, name in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def families():
    from verl_async_rm.testing.families import build_family_models

    return build_family_models()


def family_overrides(families) -> list[str]:
    from verl_async_rm.testing.families import family_settings

    out = ["reward.reward_model.n_gpus_per_node=1"]
    for name in FAMILIES:
        out += [f"+async_rm.models.{name}.model_path={families[name]}",
                f"+async_rm.models.{name}.weight={WEIGHTS[name]}"]
        out += [f"+async_rm.models.{name}.{key}={value}" for key, value in family_settings(name).items()]
    return out


def test_every_family_scores_as_its_model_card_through_the_v1_manager(ray_wide, tiny_models, policy_tok, families):
    from verl_async_rm.testing.families import reference_score
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    questions = ["how many apples does the farmer have", "what is the total cost of two books"]
    with running_manager(ray_wide, tiny_models, "v1", *family_overrides(families)) as (manager, config):
        assert set(manager.rm_services) == {"main", *FAMILIES}
        prompts = prompt_batch(questions)
        batch = V1FitLoop(config, manager).train_step(prompts)
    asked = dict(zip(prompts["uid"], questions, strict=True))
    main_rm = hf_model(tiny_models.rm)
    assert len(batch.keys) == len(questions) * N
    for i in range(len(batch.keys)):
        info, response = batch.reward_extra_info(i), batch.data["responses"][i]
        ids = [int(t) for t in response]
        while ids and ids[-1] in (policy_tok.eos_token_id, policy_tok.pad_token_id):
            ids.pop()
        conversation = [{"role": "user", "content": asked[batch.data["uid"][i]]},
                        {"role": "assistant", "content": policy_tok.decode(ids, skip_special_tokens=False)}]
        total = RM_W * direct_score(main_rm, torch.cat([batch.data["prompts"][i], response]).tolist())
        for name in FAMILIES:
            expected = reference_score(name, families[name], conversation)
            assert info[f"rm_score_{name}"] == pytest.approx(expected, abs=1e-4), name
            total += WEIGHTS[name] * expected
        assert info["rm_total"] == pytest.approx(total, abs=1e-3)
        assert batch.reward(i) == pytest.approx(total + RULE_W * info["rule_score"], abs=1e-3)
    for name in ("main", *FAMILIES):
        assert batch.metrics[f"async_rm/{name}/scored"] == len(questions) * N
        assert batch.metrics[f"async_rm/{name}/errors"] == 0
