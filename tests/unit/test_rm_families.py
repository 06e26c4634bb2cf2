"""The RMs people bring, scored in process exactly as their model cards' own recipes score them (fp32, 1e-4).

Each family is a tiny random-weight model built offline with a chat template like its public counterpart
(:mod:`verl_async_rm.testing.families`): Llama 3.1, Gemma 2, Qwen2.5, Qwen3 and Mistral sequence classification, an
InternLM2-Reward-style custom-code RM (``AutoModel``, value head, reward token, ``get_score``), an ArmoRM-style
multi-objective RM whose forward returns a custom output with a ``score`` field, and a Qwen2.5-Math-PRM-style process
RM. The policy is the tiny ChatML model, so every RM re-renders the conversation with its own template.
"""

from __future__ import annotations

import math

import pytest
from rm_cases import ANSWERS, QUESTIONS, make_request

from verl_async_rm.scoring.rm_config import RMConfig

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def families():
    from verl_async_rm.testing.families import build_family_models

    return build_family_models()


def scorer_for(families, tiny_models, name: str, **settings):
    from verl_async_rm.scoring.scorer import RewardModelScorer
    from verl_async_rm.testing.families import family_settings

    config = RMConfig(model_path=str(families[name]), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      **{**family_settings(name), **settings})
    return RewardModelScorer(config)


def conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen2", "qwen3", "mistral", "internlm2", "armorm"])
def test_each_family_scores_as_its_model_card_recipe(families, tiny_models, policy_tok, name):
    from verl_async_rm.testing.families import reference_score

    scorer = scorer_for(families, tiny_models, name)
    requests = [make_request(policy_tok, q, a, f"p{i}/0") for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS))]
    scores = scorer.score(requests)
    expected = [reference_score(name, families[name], conversation(q, a)) for q, a in zip(QUESTIONS, ANSWERS)]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert len(set(round(s, 4) for s in scores)) == len(scores)  # different texts, different scores


def test_the_internlm2_style_rm_reads_its_score_at_the_reward_token(families, tiny_models):
    scorer = scorer_for(families, tiny_models, "internlm2")
    assert scorer.kind.suffix_ids == [scorer.model.config.reward_token_id]
    assert scorer.kind.head_name == "v_head"


def test_the_armorm_style_rm_is_read_from_its_output_field(families, tiny_models):
    scorer = scorer_for(families, tiny_models, "armorm")
    assert scorer.describe()["score_output_field"] == "score"
    assert scorer.describe()["packing"] == "padded"


def test_a_missing_output_field_names_the_key_and_the_fields_there_are(families, tiny_models):
    with pytest.raises(ValueError, match=r"^score_output_field='preference'.*fields \[.*'score'.*\].*Fix: "):
        scorer_for(families, tiny_models, "armorm", score_output_field="preference")


def test_a_score_index_outside_the_output_row_is_refused(families, tiny_models):
    with pytest.raises(ValueError, match=r"^score_index=9: output.rewards has 5 value\(s\) per row.*Fix: "):
        scorer_for(families, tiny_models, "armorm", score_output_field="rewards", score_index=9)


def test_multi_objective_outputs_keep_score_index_and_reduction(families, tiny_models, policy_tok):
    scorer = scorer_for(families, tiny_models, "armorm", score_output_field="rewards", score_index=2)
    mean = scorer_for(families, tiny_models, "armorm", score_output_field="rewards", score_reduction="mean")
    request = make_request(policy_tok, QUESTIONS[0], ANSWERS[0], "p/0")
    ids, _ = scorer.prepare(request)
    import torch

    with torch.inference_mode():
        rewards = scorer.model(input_ids=torch.tensor([ids])).rewards[0]
    assert scorer.score([request])[0] == pytest.approx(float(rewards[2]), abs=1e-5)
    assert mean.score([request])[0] == pytest.approx(float(rewards.mean()), abs=1e-5)


# ----------------------------------------------------------------------------------------------- process RMs

STEPS = ["the farmer has 3 apples", "he buys 2 more", "so the answer is 5"]


def prm_request(policy_tok, steps=STEPS, uid="q/0"):
    return make_request(policy_tok, QUESTIONS[0], "\n\n".join(steps), uid)


@pytest.mark.parametrize("reduction", ["min", "mean", "last", "product"])
def test_process_reductions_equal_the_prm_card(families, tiny_models, policy_tok, reduction):
    from verl_async_rm.testing.families import reference_step_probabilities

    scorer = scorer_for(families, tiny_models, "prm", process_reduction=reduction)
    probabilities = reference_step_probabilities(families["prm"], [{"role": "user", "content": QUESTIONS[0]}], STEPS)
    expected = {"min": min, "mean": lambda p: sum(p) / len(p), "last": lambda p: p[-1], "product": math.prod}
    assert scorer.score([prm_request(policy_tok)])[0] == pytest.approx(expected[reduction](probabilities), abs=1e-4)


def test_token_level_step_rewards_land_where_each_step_ends(families, tiny_models, policy_tok):
    from verl_async_rm.scoring.process import StepRewards
    from verl_async_rm.testing.families import reference_step_probabilities

    scorer = scorer_for(families, tiny_models, "prm", process_reduction="none")
    request = prm_request(policy_tok)
    result = scorer.score([request])[0]
    assert isinstance(result, StepRewards) and result.dropped == 0
    probabilities = reference_step_probabilities(families["prm"], [{"role": "user", "content": QUESTIONS[0]}], STEPS)
    assert list(result.scores) == pytest.approx(probabilities, abs=1e-4)
    for k, index in enumerate(result.token_index):  # the response decoded up to that token ends with step k
        assert policy_tok.decode(request.response_ids[: index + 1]).endswith(STEPS[k])


def test_prm_edge_cases_empty_steps_and_no_delimiter(families, tiny_models, policy_tok):
    from verl_async_rm.testing.families import reference_step_probabilities

    scorer = scorer_for(families, tiny_models, "prm", process_reduction="none")
    prompt = [{"role": "user", "content": QUESTIONS[0]}]
    gaps = make_request(policy_tok, QUESTIONS[0], "\n\n".join([STEPS[0], "", " ", STEPS[1]]) + "\n\n", "g/0")
    one = make_request(policy_tok, QUESTIONS[0], "the answer is 5", "o/0")
    with_gaps, single = scorer.score([gaps, one])
    assert list(with_gaps.scores) == pytest.approx(reference_step_probabilities(families["prm"], prompt, STEPS[:2]))
    alone = reference_step_probabilities(families["prm"], prompt, ["the answer is 5"])
    assert list(single.scores) == pytest.approx(alone)
    assert len(single.token_index) == 1


def test_a_separator_missing_from_the_rm_vocabulary_is_refused_at_start_up(families, tiny_models):
    with pytest.raises(ValueError, match=r"^step_separator='<extra_9>'.*Fix: "):
        scorer_for(families, tiny_models, "prm", step_separator="<extra_9>")


def test_long_inputs_lose_the_prompt_first_then_the_first_steps(families, tiny_models, policy_tok):
    full = scorer_for(families, tiny_models, "prm", process_reduction="none")
    request = make_request(policy_tok, " ".join([QUESTIONS[0]] * 8), "\n\n".join(STEPS), "long/0")
    prepared = full.kind.build(request)
    steps_only = len(prepared.ids) - prepared.reads[0] + 12  # room for the three steps and a little prompt
    fits = scorer_for(families, tiny_models, "prm", process_reduction="none", max_length=steps_only)
    kept = fits.score([request])[0]
    assert len(kept.scores) == 3 and kept.dropped == 0 and fits.stats().truncated == 1
    too_short = scorer_for(families, tiny_models, "prm", process_reduction="none",
                           max_length=len(prepared.ids) - prepared.reads[1] + 1)
    last = too_short.score([request])[0]
    assert last.dropped >= 1 and len(last.scores) == 3 - last.dropped
    assert list(last.token_index) == list(full.score([request])[0].token_index)[last.dropped:]
    assert too_short.stats().steps_dropped == last.dropped


# ----------------------------------------------------------------------------------- the tiny families themselves

@pytest.mark.parametrize("name", ["llama", "gemma2", "mistral", "internlm2", "armorm"])
def test_templates_that_write_bos_give_one_bos(families, name):
    from transformers import AutoTokenizer

    from verl_async_rm.testing.families import _input_ids

    tok = AutoTokenizer.from_pretrained(families[name])
    ids = _input_ids(tok.apply_chat_template(conversation("q", "a"), tokenize=True))
    ids = list(ids[0] if hasattr(ids[0], "__len__") else ids)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # the tokenizer adds one too, like the public ones


@pytest.mark.parametrize(("name", "system"), [("llama", "Cutting Knowledge Date"), ("qwen2", "You are Qwen"),
                                              ("prm", "Please reason step by step"), ("qwen3", None)])
def test_default_system_messages(families, name, system):
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(families[name]).apply_chat_template(conversation("q", "a"), tokenize=False)
    assert (system in text) if system else ("system" not in text)


def test_gemma_has_no_system_role_and_calls_the_assistant_model(families):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(families["gemma2"])
    assert "<start_of_turn>model\na<end_of_turn>" in tok.apply_chat_template(conversation("q", "a"), tokenize=False)
    with pytest.raises(Exception, match="System role not supported"):
        tok.apply_chat_template([{"role": "system", "content": "s"}, *conversation("q", "a")], tokenize=False)


@pytest.mark.parametrize("name", ["internlm2", "armorm"])
def test_custom_code_rms_need_trust_remote_code(families, tiny_models, name):
    with pytest.raises(ValueError, match=r"^trust_remote_code=False.*Fix: set trust_remote_code=True"):
        scorer_for(families, tiny_models, name, trust_remote_code=False)


def test_an_automodel_coded_rm_of_a_known_model_type_needs_trust_remote_code_before_anything_loads(families, tmp_path):
    """Like Qwen2.5-Math-PRM (model_type qwen2, its own AutoModel code): without trust_remote_code transformers would
    load the bare Qwen2 backbone and drop the reward head; the config.json check refuses it, on the driver too."""
    import json
    import shutil

    from verl_async_rm.scoring.checkpoint import check_rm_checkpoint

    rm = tmp_path / "rm"
    shutil.copytree(families["internlm2"], rm)
    config = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"^trust_remote_code=False.*auto_map.*Fix: "):
        check_rm_checkpoint(str(rm), trust_remote_code=False)
    check_rm_checkpoint(str(rm), trust_remote_code=True)
