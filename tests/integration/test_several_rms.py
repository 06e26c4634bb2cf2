"""Several RMs at once (``async_rm.models.<name>.*``) on verl's v1 trainer, each with its own pool, replicas and
batcher.

The run scores with the tiny RM (``main``: ChatML, reuses the policy's token ids, weight ``RM_W``) and ``alt`` (the
Llama-3-templated tiny RM with its own tokenizer, so its input is re-rendered; weight ``ALT_W``), plus verl's rule
through the ``async_rm`` manager (``RULE_W``). Every reward must equal ``RM_W * main + ALT_W * alt + RULE_W * rule``,
each RM score computed here with plain transformers; a killed replica of ``alt`` loses nothing.
"""

from __future__ import annotations


import pytest
import ray
import torch
from manager_cases import RM_W, RULE_W, TWO_REPLICAS, running_manager, wait_until_busy
from rm_cases import direct_score, hf_model

pytestmark = pytest.mark.integration

N = 2  # rollout.n
ALT_W = -0.5


def two_rms(tiny_models) -> list[str]:
    return [TWO_REPLICAS, f"+async_rm.models.alt.model_path={tiny_models.rm_alt}",
            f"+async_rm.models.alt.weight={ALT_W}", "+async_rm.models.alt.n_gpus_per_node=2",
            "+async_rm.models.alt.max_wait_ms=10"]


@pytest.fixture(scope="module")
def loop(ray_local, tiny_models):
    from verl_async_rm.testing.v1 import V1FitLoop

    with running_manager(ray_local, tiny_models, "v1", *two_rms(tiny_models)) as (manager, config):
        yield V1FitLoop(config, manager), manager


def alt_direct(tiny_models, policy_tok, question: str, response_ids) -> float:
    """alt's score by hand: the response decoded, the conversation rendered with alt's own chat template and
    tokenizer (one BOS: its template writes one and its tokenizer adds another), one plain forward."""
    from transformers import AutoTokenizer

    alt_tok = AutoTokenizer.from_pretrained(tiny_models.rm_alt)
    response = [int(t) for t in response_ids]
    while response and response[-1] in (policy_tok.eos_token_id, policy_tok.pad_token_id):
        response.pop()
    conversation = [{"role": "user", "content": question},
                    {"role": "assistant", "content": policy_tok.decode(response, skip_special_tokens=False)}]
    ids = alt_tok(alt_tok.apply_chat_template(conversation, tokenize=False))["input_ids"]
    if ids[:2] == [alt_tok.bos_token_id] * 2:
        ids = ids[1:]
    return direct_score(hf_model(tiny_models.rm_alt), ids)


def test_each_reward_is_the_weighted_sum_of_both_rms_and_the_rule(loop, tiny_models, policy_tok):
    from verl_async_rm.testing.v1 import prompt_batch

    fit, manager = loop
    questions = ["how many apples does the farmer have", "what is the total cost of two books"]
    prompts = prompt_batch(questions)
    asked = dict(zip(prompts["uid"], questions, strict=True))
    batch = fit.train_step(prompts)
    main_rm = hf_model(tiny_models.rm)
    assert len(batch.keys) == 2 * N
    for i in range(len(batch.keys)):
        info, response = batch.reward_extra_info(i), batch.data["responses"][i]
        main = direct_score(main_rm, torch.cat([batch.data["prompts"][i], response]).tolist())
        alt = alt_direct(tiny_models, policy_tok, asked[batch.data["uid"][i]], response)
        rule = (len(policy_tok.decode(response, skip_special_tokens=True)) % 7) / 7.0
        assert info["rm_score"] == info["rm_score_main"] == pytest.approx(main, abs=1e-4)
        assert info["rm_score_alt"] == pytest.approx(alt, abs=1e-4)
        assert info["rm_total"] == pytest.approx(RM_W * main + ALT_W * alt, abs=1e-4)
        assert info["rule_score"] == pytest.approx(rule)
        assert batch.reward(i) == pytest.approx(RM_W * main + ALT_W * alt + RULE_W * rule, abs=1e-4)
    m = batch.metrics
    assert m["async_rm/scored"] == 2 * N and m["async_rm/errors"] == 0
    for name in ("main", "alt"):  # each RM's own service figures
        assert m[f"async_rm/{name}/scored"] == 2 * N and m[f"async_rm/{name}/batches"] >= 1
        assert m[f"async_rm/{name}/replicas_usable"] == 2
    assert set(manager.rm_services) == {"main", "alt"}


def test_a_replica_of_the_second_rm_killed_mid_step_loses_no_trajectory(loop):
    from verl_async_rm.testing.v1 import prompt_batch

    fit, manager = loop
    alt = manager.rm_services["alt"]
    victim = ray.get_actor(ray.get(alt.describe.remote(), timeout=60)[0]["actor_name"])
    fit.dispatch(prompt_batch([f"question {i}" for i in range(4)]))
    wait_until_busy(alt)  # kill it while it (or its queue) holds this step's work
    ray.kill(victim)
    batch = fit.train_step(None, batch_size=4)
    assert len(batch.keys) == 4 * N
    assert batch.metrics["async_rm/scored"] == 4 * N and batch.metrics["async_rm/errors"] == 0
    assert batch.metrics["async_rm/alt/scored"] == 4 * N and batch.metrics["async_rm/main/scored"] == 4 * N
    assert all(batch.reward_extra_info(i)["rm_score_alt"] == batch.reward_extra_info(i)["rm_score_alt"]  # not NaN
               for i in range(len(batch.keys)))
