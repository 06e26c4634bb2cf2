"""Bad input (issue 7): each case either is handled correctly (and scored like a direct HF forward) or stops with an
error that names the key or the trajectory, the value and the fix. Never a silent 0.0, never an index error deep in
torch.

docs/faults.md ("Faults and troubleshooting") lists each case. Cases already covered elsewhere are not repeated here:
NaN score (test_rm_scorer.py::test_nan_score_fails_only_its_item, tests/integration/test_rm_worker_group.py), RM dir
missing (test_rm_scorer.py::test_missing_model_dir_is_a_clear_error), ``enable=True`` and legacy keys
(test_async_rm_config.py), batching knobs (test_batcher_policy.py, test_async_rm_config.py), more resources than the
cluster has (tests/integration/test_rm_worker_group.py, tests/integration/test_rm_bad_input.py).

Float32 on CPU; scores are compared with a direct HF forward of the same ids within 1e-4 (see test_rm_scorer.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rm_cases import ANSWERS, QUESTIONS, direct_score, hf_model, make_batch, make_request

from verl_async_rm.errors import NonFiniteScoreError, RewardInputError
from verl_async_rm.integration.checks import check_verl_config
from verl_async_rm.scoring.checkpoint import check_rm_checkpoint
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.scorer import RewardModelScorer
from verl_async_rm.testing import compose_trainer_config

pytestmark = pytest.mark.unit

ATOL = RTOL = 1e-4


def cpu_config(model_path, policy_path, **kwargs) -> RMConfig:
    return RMConfig(model_path=str(model_path), policy_tokenizer_path=str(policy_path), use_gpu=False, **kwargs)


def verl_config(models, *overrides: str, rm_path=None):
    """verl's real ppo_trainer config with the smallest set of keys the plugin accepts (see test_async_rm_config)."""
    keys = [
        "reward.reward_model.enable_resource_pool=True",
        "reward.reward_model.n_gpus_per_node=2",
        "reward.reward_model.nnodes=1",
        f"reward.reward_model.model_path={rm_path or models.rm}",
        "reward.reward_manager.name=async_rm",
    ]
    return compose_trainer_config(models.policy, trainer="v1", overrides=keys + list(overrides))


@pytest.fixture(scope="module")
def requests_(policy_tok):
    return make_batch(policy_tok)


@pytest.fixture(scope="module")
def scorer(tiny_models):
    return RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy))


@pytest.fixture(scope="module")
def alt_scorer(tiny_models):
    return RewardModelScorer(cpu_config(tiny_models.rm_alt, tiny_models.policy))


@pytest.fixture(scope="module")
def alt_tok(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models.rm_alt)


def alt_reference(alt_tok, model, messages, answer: str) -> tuple[list[int], float]:
    """The rm_alt input rendered by hand (its template renders BOS, its tokenizer adds another: keep one)."""
    text = alt_tok.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
    ids = alt_tok(text.removeprefix(alt_tok.bos_token))["input_ids"]
    return ids, direct_score(model, ids)


# --------------------------------------------------------------------------------------------- empty response


def test_empty_response_is_scored_like_the_prompt_alone(scorer, tiny_models, policy_tok, requests_):
    """Same tokenizer: an empty response (or one that is only EOS) is a real input and gets the RM's real score."""
    model = hf_model(tiny_models.rm)
    prompt = requests_[0].prompt_ids
    empty = RMRequest("empty", prompt, [], requests_[0].raw_prompt)
    only_eos = RMRequest("eos", prompt, [policy_tok.eos_token_id], requests_[0].raw_prompt)
    scores = scorer.score([empty, only_eos, requests_[1]])
    assert scores[0] == pytest.approx(direct_score(model, prompt), abs=ATOL, rel=RTOL)
    assert scores[1] == pytest.approx(direct_score(model, [*prompt, policy_tok.eos_token_id]), abs=ATOL, rel=RTOL)
    assert scores[2] == pytest.approx(scorer.score([requests_[1]])[0], abs=ATOL, rel=RTOL)


def test_empty_response_is_rendered_as_an_empty_assistant_turn(alt_scorer, alt_tok, tiny_models, policy_tok):
    """Other template: the empty (or EOS-only) response becomes an assistant turn with empty content."""
    model = hf_model(tiny_models.rm_alt)
    base = make_request(policy_tok, QUESTIONS[0], "x", "base")
    empty = RMRequest("empty", base.prompt_ids, [], base.raw_prompt)
    only_eos = RMRequest("eos", base.prompt_ids, [policy_tok.eos_token_id], base.raw_prompt)
    ids, expected = alt_reference(alt_tok, model, base.raw_prompt, "")
    assert alt_scorer.prepare(empty) == (ids, False)
    assert alt_scorer.score([empty, only_eos]) == pytest.approx([expected, expected], abs=ATOL, rel=RTOL)


def test_no_prompt_and_no_response_fails_only_that_item(scorer, requests_):
    results = scorer.score([RMRequest("void", [], []), requests_[0]])
    assert isinstance(results[0], RewardInputError)
    assert str(results[0]).startswith("trajectory void: empty RM input")
    assert isinstance(results[1], float)


# ------------------------------------------------------------------------------------ longer than max_length


def test_a_response_longer_than_max_length_keeps_its_end(tiny_models, policy_tok):
    """Even the response alone exceeds max_length: the prompt is gone, the response's end (where the score is read)
    is kept, the input is scored and counted as truncated."""
    answer = "the farmer has five apples and " * 10 + "so the answer is five"
    long = make_request(policy_tok, QUESTIONS[0], answer, "long")
    assert len(long.response_ids) > 16
    trunc = RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy, max_length=16))
    ids, cut = trunc.prepare(long)
    assert cut and ids == long.response_ids[-16:]
    assert trunc.score([long]) == pytest.approx([direct_score(hf_model(tiny_models.rm), ids)], abs=ATOL, rel=RTOL)
    assert trunc.stats().truncated == 1 and trunc.stats().failed == 0


def test_a_retemplated_response_longer_than_max_length_keeps_bos_and_its_end(tiny_models, policy_tok, alt_tok):
    answer = "the farmer has five apples and " * 10 + "so the answer is five"
    long = make_request(policy_tok, QUESTIONS[0], answer, "long")
    trunc = RewardModelScorer(cpu_config(tiny_models.rm_alt, tiny_models.policy, max_length=24))
    full, _ = alt_reference(alt_tok, hf_model(tiny_models.rm_alt), long.raw_prompt, answer)
    ids, cut = trunc.prepare(long)
    assert cut and ids == [alt_tok.bos_token_id, *full[-23:]]
    assert alt_tok.decode(ids).endswith("so the answer is five<|eot_id|>")
    expected = direct_score(hf_model(tiny_models.rm_alt), ids)
    assert trunc.score([long]) == pytest.approx([expected], abs=ATOL, rel=RTOL)


def test_max_length_beyond_the_rm_positions_is_warned(tiny_models, caplog):
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(tiny_models.rm).max_position_embeddings
    with caplog.at_level("WARNING", logger="verl_async_rm"):  # the package: robust to where the check lives
        RewardModelScorer(cpu_config(tiny_models.rm, tiny_models.policy, max_length=positions + 1))
    assert any(f"max_position_embeddings={positions}" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------ missing raw_prompt


def test_missing_raw_prompt_fails_the_item_only_when_the_rm_retemplates(scorer, alt_scorer, policy_tok):
    """Built like the agent-loop worker builds it (from a real verl AgentLoopOutput) with no raw_prompt."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    good = make_request(policy_tok, QUESTIONS[1], ANSWERS[1], "good")
    output = AgentLoopOutput(
        prompt_ids=good.prompt_ids, response_ids=good.response_ids, response_mask=[1] * len(good.response_ids),
        num_turns=2, metrics=AgentLoopMetrics(),
    )
    no_prompt = RMRequest.from_agent_loop_output(output, uid="np/0", raw_prompt=None)
    results = alt_scorer.score([no_prompt, good])
    assert isinstance(results[0], RewardInputError)
    assert "trajectory np/0: raw_prompt is missing" in str(results[0])
    assert "under 'raw_prompt'" in str(results[0])
    assert isinstance(results[1], float)
    # Same tokenizer and template: the ids are reused and raw_prompt is not needed.
    assert scorer.score([no_prompt]) == pytest.approx(scorer.score([good]), abs=ATOL, rel=RTOL)


# ------------------------------------------------------------------------- RM path is not a sequence classifier


def test_a_causal_lm_given_as_the_rm_is_refused_at_config_time_and_at_load(tiny_models):
    """The tiny policy is a Qwen2ForCausalLM: transformers would load it as a classifier with a random head."""
    config = verl_config(tiny_models, rm_path=tiny_models.policy)
    with pytest.raises(ValueError, match=r"model_path='.*policy': its config.json lists "
                       r"architectures=\['Qwen2ForCausalLM'\].*Fix: point the RM path \(verl: "
                       r"reward\.reward_model\.model_path\)"):
        check_verl_config(config)
    with pytest.raises(ValueError, match=r"architectures=\['Qwen2ForCausalLM'\]"):
        RewardModelScorer(cpu_config(tiny_models.policy, tiny_models.policy))


def test_a_checkpoint_without_a_trained_head_is_refused_at_load(tiny_models, tmp_path):
    """A base model (no head, architectures=['Qwen2Model']) passes the config.json check but not the load check."""
    from transformers import AutoModel, AutoTokenizer

    AutoModel.from_pretrained(tiny_models.policy).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_models.policy).save_pretrained(tmp_path)
    check_rm_checkpoint(str(tmp_path), trust_remote_code=False)
    with pytest.raises(ValueError, match=r"the checkpoint has no weights for score\.weight, so "
                       r"Qwen2ForSequenceClassification would score with randomly initialised parameters.*Fix"):
        RewardModelScorer(cpu_config(tmp_path, tiny_models.policy))


def test_a_directory_that_is_not_a_checkpoint_is_refused(tiny_models, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model_path='.*': no config\.json in that directory.*Fix"):
        check_verl_config(verl_config(tiny_models, rm_path=tmp_path))
    with pytest.raises(ValueError, match=r"no config\.json"):
        RewardModelScorer(cpu_config(tmp_path, tiny_models.policy))


def test_an_rm_path_only_on_other_nodes_is_left_to_the_replicas(tiny_models):
    check_verl_config(verl_config(tiny_models, rm_path="/not/on/this/driver/rm"))


# ---------------------------------------------------------------------------------- RM without a chat template


def save_without_template(src, dst: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = None
    hf_model(src).save_pretrained(dst)
    tok.save_pretrained(dst)
    assert AutoTokenizer.from_pretrained(dst).chat_template is None
    return dst


def test_an_rm_tokenizer_without_a_chat_template_is_refused_when_retemplating(tiny_models, tmp_path):
    path = save_without_template(tiny_models.rm_alt, tmp_path / "alt")
    with pytest.raises(ValueError, match=r"model_path='.*alt': the RM tokenizer has no chat template.*"
                       r"Fix: give it one.*retemplate='never'"):
        RewardModelScorer(cpu_config(path, tiny_models.policy))


def test_an_rm_sharing_the_policy_vocab_without_a_template_can_reuse_ids(tiny_models, tmp_path, requests_, scorer):
    """The tiny RM without its template: 'auto' must re-template (templates differ) and refuses; 'never' reuses the
    policy's ids and scores exactly like the RM with its template."""
    path = save_without_template(tiny_models.rm, tmp_path / "rm")
    with pytest.raises(ValueError, match="has no chat template"):
        RewardModelScorer(cpu_config(path, tiny_models.policy))
    reuse = RewardModelScorer(cpu_config(path, tiny_models.policy, retemplate="never"))
    assert reuse.score(requests_) == pytest.approx(scorer.score(requests_), abs=ATOL, rel=RTOL)


# --------------------------------------------------------------------------------------------------- inf score


def test_an_infinite_score_fails_each_item_and_never_becomes_a_number(tiny_models, requests_, tmp_path):
    from transformers import AutoTokenizer

    model = hf_model(tiny_models.rm)
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.weight[0, 0] = float("inf")
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_models.rm).save_pretrained(tmp_path)
    inf_scorer = RewardModelScorer(cpu_config(tmp_path, tiny_models.policy))
    results = inf_scorer.score(requests_)
    assert all(isinstance(r, NonFiniteScoreError) for r in results), results
    assert any(str(r).endswith("the RM returned inf") or str(r).endswith("returned -inf") for r in results)
    assert inf_scorer.stats().failed == len(requests_)


# ------------------------------------------------------------------------------------- mismatched vocabularies


def test_an_rm_with_another_vocabulary_scores_through_text(alt_scorer, alt_tok, policy_tok, tiny_models, requests_):
    assert alt_tok.get_vocab() != policy_tok.get_vocab()
    assert alt_scorer.kind.retemplate is True
    model = hf_model(tiny_models.rm_alt)
    expected = [alt_reference(alt_tok, model, r.raw_prompt, a)[1] for r, a in zip(requests_, ANSWERS, strict=True)]
    assert alt_scorer.score(requests_) == pytest.approx(expected, abs=ATOL, rel=RTOL)


def test_reusing_ids_across_vocabularies_is_refused(tiny_models):
    with pytest.raises(ValueError, match=r"retemplate='never': the RM's vocabulary .* differs from the policy's.*"
                       r"Fix: use retemplate='auto'"):
        RewardModelScorer(cpu_config(tiny_models.rm_alt, tiny_models.policy, retemplate="never"))


@pytest.mark.parametrize("bad_id", [10**6, -1])
def test_token_ids_outside_the_vocabulary_fail_only_their_item(scorer, alt_scorer, requests_, policy_tok, bad_id):
    """Reused ids index the RM's embedding; decoded ids the policy tokenizer: either way a clear per-item error,
    and the other items of the same micro-batch keep their scores."""
    from transformers import AutoConfig

    policy_rows = AutoConfig.from_pretrained(alt_scorer.config.policy_tokenizer_path).vocab_size
    assert alt_scorer.kind.policy_id_limit == max(len(policy_tok), policy_rows)
    good = requests_[0]
    bad = RMRequest("bad", good.prompt_ids, [*good.response_ids[:-1], bad_id], good.raw_prompt)
    for which, rm, size in (
        ("the RM's embedding table", scorer, scorer.kind.vocab_size),
        ("the policy tokenizer's vocabulary", alt_scorer, alt_scorer.kind.policy_id_limit),
    ):
        results = rm.score([good, bad, requests_[1]])
        assert isinstance(results[1], RewardInputError)
        assert f"trajectory bad: response_ids holds token id {bad_id}, outside {which} ({size} ids)" in str(results[1])
        assert [results[0], results[2]] == pytest.approx(rm.score([good, requests_[1]]), abs=ATOL, rel=RTOL)


def test_padded_embedding_rows_of_the_policy_are_not_an_error(tiny_models, policy_tok, alt_tok, tmp_path, requests_):
    """A policy whose embedding has more rows than its tokenizer has ids (Qwen pads to 151936) may, rarely, sample
    a padded id: it has no text, so the decoded response is the same as without it, as in verl's own decode."""
    policy = tmp_path / "policy"
    shutil.copytree(tiny_models.policy, policy)
    config = json.loads((policy / "config.json").read_text())
    config["vocab_size"] = len(policy_tok) + 64
    (policy / "config.json").write_text(json.dumps(config))
    alt = RewardModelScorer(cpu_config(tiny_models.rm_alt, policy))
    assert alt.kind.policy_id_limit == len(policy_tok) + 64
    good = requests_[0]
    padded = RMRequest("padded", good.prompt_ids, [*good.response_ids[:-1], len(policy_tok) + 3, good.response_ids[-1]],
                       good.raw_prompt)
    assert alt.prepare(padded) == alt.prepare(good)
    assert alt.score([padded]) == pytest.approx(alt.score([good]), abs=ATOL, rel=RTOL)


# ------------------------------------------------------------------------------------------ pool size <= 0


@pytest.mark.parametrize("key", ["n_gpus_per_node", "nnodes"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_pool_size_below_one_stops_before_ray_starts(tiny_models, key, value):
    """check_verl_config runs in `python -m verl_async_rm.main_ppo` before Ray starts (and in the manager)."""
    with pytest.raises(ValueError) as info:
        check_verl_config(verl_config(tiny_models, f"reward.reward_model.{key}={value}"))
    assert str(info.value).startswith(f"reward.reward_model.{key}={value}: the reward pool needs at least")
    assert f"Fix: set reward.reward_model.{key} to a positive integer" in str(info.value)


def test_bad_async_rm_keys_stop_before_ray_starts(tiny_models):
    with pytest.raises(ValueError, match=r"async_rm\.max_batch_size must be >= 1, got 0"):
        check_verl_config(verl_config(tiny_models, "+async_rm.max_batch_size=0"))
    with pytest.raises(ValueError, match=r"unknown key async_rm\.max_batch"):
        check_verl_config(verl_config(tiny_models, "+async_rm.max_batch=8"))


# -------------------------------------------------------------------------------------- trust_remote_code


def save_remote_code_rm(src, dst: Path) -> Path:
    """A copy of the tiny RM whose model class lives in the checkpoint's own Python files (``auto_map``)."""
    shutil.copytree(src, dst)
    (dst / "configuration_tiny_remote.py").write_text(
        "from transformers import Qwen2Config\n\n\n"
        "class TinyRemoteConfig(Qwen2Config):\n"
        "    model_type = 'tiny_remote_rm'\n"
    )
    (dst / "modeling_tiny_remote.py").write_text(
        "from torch import nn\n"
        "from transformers import Qwen2ForSequenceClassification, Qwen2Model, Qwen2PreTrainedModel\n\n"
        "from .configuration_tiny_remote import TinyRemoteConfig\n\n\n"
        "class TinyRemoteRM(Qwen2ForSequenceClassification):\n"
        "    config_class = TinyRemoteConfig\n\n"
        "    def __init__(self, config):\n"
        "        Qwen2PreTrainedModel.__init__(self, config)\n"
        "        self.num_labels = config.num_labels\n"
        "        self.model = Qwen2Model(config)\n"
        "        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)\n"
        "        self.post_init()\n"
    )
    config = json.loads((dst / "config.json").read_text())
    config.update(
        model_type="tiny_remote_rm",
        architectures=["TinyRemoteRM"],
        auto_map={
            "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
            "AutoModelForSequenceClassification": "modeling_tiny_remote.TinyRemoteRM",
        },
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def test_custom_code_needs_trust_remote_code(tiny_models, tmp_path, requests_, scorer):
    path = save_remote_code_rm(tiny_models.rm, tmp_path / "remote_rm")
    message = (r"trust_remote_code=False: the RM at .*remote_rm \(model_type='tiny_remote_rm'\) is defined by its own "
               r"Python code .* Fix: set trust_remote_code=True \(verl: \+async_rm\.trust_remote_code=True\)")
    with pytest.raises(ValueError, match=message):
        check_verl_config(verl_config(tiny_models, rm_path=path))
    with pytest.raises(ValueError, match=message):
        RewardModelScorer(cpu_config(path, tiny_models.policy))
    check_verl_config(verl_config(tiny_models, "+async_rm.trust_remote_code=True", rm_path=path))
    trusted = RewardModelScorer(cpu_config(path, tiny_models.policy, trust_remote_code=True))
    assert type(trusted.model).__name__ == "TinyRemoteRM"
    assert trusted.score(requests_) == pytest.approx(scorer.score(requests_), abs=ATOL, rel=RTOL)


def test_config_errors_survive_pickling():
    """An RM replica's ConfigValueError crosses Ray by pickle: it must come back whole, message included."""
    import pickle

    from verl_async_rm.errors import ConfigValueError

    err = ConfigValueError("model_path", "/models/x", "not an RM", "set {key} to an RM")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ConfigValueError and str(back) == str(err) == "model_path='/models/x': not an RM. Fix: set " \
        "model_path to an RM"
    assert (back.key, back.value, back.why, back.fix) == (err.key, err.value, err.why, err.fix)
