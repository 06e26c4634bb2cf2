"""``engine='vllm'``: RM replicas that score on vLLM's pooling engine (its CPU build) inside the plugin's service.

Real parts throughout: RM services on the local Ray cluster, a replica that runs a vLLM engine in its own process,
the tiny RM (head dimension 32). Every score is compared with a plain transformers forward of the same ids (fp32,
1e-4). The faults are real too: a row whose RM score is NaN (the NaN-RM's ``</s>``), a copy of the RM that vLLM
pools differently (a sentence-transformers mean-pooling config, which vLLM honours and transformers ignores), and a
copy vLLM's CPU attention cannot run (head dimension 16).

These tests skip with the reason where vLLM cannot run; ``VERL_ASYNC_RM_REQUIRE_VLLM=1`` (set by ``.ci/run``) turns
that skip into a failure.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time

import pytest
import ray
from conftest import require_vllm
from rm_cases import ANSWERS, QUESTIONS, direct_score, hf_model, make_request, score_all

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.errors import NonFiniteScoreError, RewardModelError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.client import score_with_timeout
from verl_async_rm.service.service import start_rm_service

pytestmark = pytest.mark.integration

ATOL = 1e-4
HANG_S = 180.0


@pytest.fixture(scope="module")
def vllm_required():
    require_vllm()


def config(model_path, policy_path, replicas: int = 2, **kwargs) -> RMConfig:
    return RMConfig(model_path=str(model_path), policy_tokenizer_path=str(policy_path), use_gpu=False,
                    n_gpus_per_node=replicas, nnodes=1, placement_timeout_s=60, init_timeout_s=180, **kwargs)


def start(cfg: RMConfig, **policy):
    return start_rm_service(cfg, BatchPolicy(**{"max_batch_size": 16, "max_wait_ms": 20, **policy}),
                            name=f"vllm_engine_{time.monotonic_ns()}")


def stop(service) -> None:
    ray.get(service.close.remote(), timeout=HANG_S)
    ray.kill(service)


def requests(policy_tok, n: int, tag: str):
    pairs = [(q, a) for q in QUESTIONS for a in ANSWERS]
    # GRPO-like: siblings of one prompt share a group, so vLLM's prefix cache sees common prompts
    return [make_request(policy_tok, *pairs[i % len(pairs)], uid=f"{tag}{i}", group=f"{tag}{i % 3}")
            for i in range(n)]


def expected(model_path, reqs) -> list[float]:
    model = hf_model(model_path)
    return [direct_score(model, r.prompt_ids + r.response_ids) for r in reqs]


@pytest.fixture(scope="module")
def vllm_service(ray_local, vllm_required, tiny_models, nan_rm):
    """One vLLM replica of the NaN-RM (the tiny RM, except that ``</s>`` gives NaN). A vLLM replica lost and
    replaced (its rank killed under load): ``test_tp_replicas.py``."""
    service = start(config(nan_rm[0], tiny_models.policy, replicas=1, engine="vllm"))
    yield service
    stop(service)


def test_vllm_replicas_score_every_request_as_transformers(vllm_service, nan_rm, policy_tok):
    reqs = requests(policy_tok, 40, "a")

    async def main():
        scores = await asyncio.gather(*(score_with_timeout(vllm_service, r, timeout_s=HANG_S) for r in reqs))
        return scores, await vllm_service.describe.remote()

    scores, described = asyncio.run(main())
    assert scores == pytest.approx(expected(nan_rm[0], reqs), abs=ATOL)
    assert len(described) == 1
    for info in described:
        assert info["engine"] == "vllm" and info["packing"] == "vllm" and info["vllm"]
        assert "load-time check inputs as transformers within" in info["engine_reason"]


def test_a_row_that_scores_nan_on_vllm_fails_alone(vllm_service, nan_rm, policy_tok):
    """The module's service, last: a row whose K/V are NaN stays in vLLM's KV-cache blocks; on vLLM's CPU build a later
    row of the same engine was once seen to score NaN after it (failed as NonFiniteScoreError, never silently; see
    docs/engines.md), so no other test uses the engine after this one."""
    reqs = requests(policy_tok, 6, "p")
    reqs[2].response_ids = [*reqs[2].response_ids, nan_rm[1]]  # ends in the NaN-RM's poisoned token
    results = score_all(vllm_service, reqs, HANG_S)
    assert isinstance(results[2], NonFiniteScoreError)
    good = [r for i, r in enumerate(reqs) if i != 2]
    assert [s for i, s in enumerate(results) if i != 2] == pytest.approx(expected(nan_rm[0], good), abs=ATOL)


@pytest.fixture(scope="module")
def mean_pooled_rm(tiny_models, tmp_path_factory):
    """The tiny RM with a sentence-transformers mean-pooling config: vLLM pools every token, transformers' sequence
    classification still reads the last one, so the engines disagree."""
    out = tmp_path_factory.mktemp("mean_pooled_rm") / "rm"
    shutil.copytree(tiny_models.rm, out)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    return out


@pytest.fixture(scope="module")
def head_dim_16_rm(tiny_models, tmp_path_factory):
    """The tiny RM read with 4 heads of 16 (same weights): transformers runs it, vLLM's CPU attention does not."""
    out = tmp_path_factory.mktemp("head_dim_16_rm") / "rm"
    shutil.copytree(tiny_models.rm, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_attention_heads=cfg["hidden_size"] // 16, num_key_value_heads=cfg["hidden_size"] // 16)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_the_load_time_check_refuses_a_model_vllm_scores_differently_and_says_why(ray_local, vllm_required,
                                                                                    tiny_models, mean_pooled_rm):
    with pytest.raises(RewardModelError, match=r"engine='vllm'.*scores the load-time check inputs differently") as err:
        start(config(mean_pooled_rm, tiny_models.policy, replicas=1, engine="vllm"))
    assert re.search(r"engine='vllm'.*differently from transformers.*Fix: use engine='transformers'", str(err.value)), \
        str(err.value)


def test_vllm_refuses_an_rm_it_cannot_run_and_says_why(ray_local, vllm_required, tiny_models, head_dim_16_rm):
    with pytest.raises(RewardModelError,
                       match=r"engine='vllm'.*vLLM could not run the RM.*Fix: use engine='transformers'"):
        start(config(head_dim_16_rm, tiny_models.policy, replicas=1, engine="vllm"))


def test_settings_vllm_does_not_serve_are_refused_before_any_load(tiny_models):
    """No engine needed: process RMs and output fields are refused with engine='vllm'; replicas of several GPUs are
    not (one tensor-parallel engine each)."""
    from verl_async_rm.scoring.vllm_engine import unsupported as vllm_unsupported

    with pytest.raises(ValueError, match=r"engine='vllm': the plugin scores process RMs on transformers only.*"
                                         r"Fix: use engine='transformers'"):
        config(tiny_models.rm, tiny_models.policy, engine="vllm", reward_kind="process", step_separator="<s>")
    sharded = config(tiny_models.rm, tiny_models.policy, engine="transformers", gpus_per_replica=2)
    assert vllm_unsupported(sharded) is None
    process = config(tiny_models.rm, tiny_models.policy, engine="transformers", reward_kind="process",
                     step_separator="<s>")
    assert "process RMs" in vllm_unsupported(process)
    assert vllm_unsupported(config(tiny_models.rm, tiny_models.policy, engine="transformers")) is None


@ray.remote(num_cpus=0, max_calls=1)  # a process of its own, which exits after: vLLM's in-process state goes with it
def _engine_probe(rm_path: str, policy_path: str, ids: list) -> tuple[list, str, bool, str]:
    """One engine for two checks (each vLLM start is seconds of a 2-core machine): an RM whose weights exceed one
    GPU of its replica (no transformers copy to compare with), scored; then its engine broken under it."""
    import verl_async_rm.scoring.scorer as scorer_module
    from verl_async_rm.errors import EngineDeadError

    scorer_module.fits_one_device = lambda config, device: False
    scorer = scorer_module.RewardModelScorer(RMConfig(model_path=rm_path, policy_tokenizer_path=policy_path,
                                                      use_gpu=False, engine="vllm"))
    forward = scorer.engine
    values = forward.score_all(ids, 1024)
    reason, loaded = scorer.engine_reason, scorer.model is not None
    forward.llm.llm_engine.engine_core.shutdown()  # the engine breaks under the replica
    try:
        forward.score_all(ids[:2], 1024)
        outcome = "no EngineDeadError"
    except EngineDeadError as err:
        outcome = str(err)
    forward.close()
    return values, reason, loaded, outcome


@pytest.fixture(scope="module")
def engine_probe(ray_local, vllm_required, tiny_models, policy_tok):
    """``(ids, values, reason, loaded, outcome)`` of :func:`_engine_probe` on four trajectories."""
    ids = [r.prompt_ids + r.response_ids for r in requests(policy_tok, 4, "s")]
    return (ids, *ray.get(_engine_probe.remote(str(tiny_models.rm), str(tiny_models.policy), ids), timeout=HANG_S))


def test_an_rm_too_large_for_one_device_gets_the_smaller_check_and_scores_as_transformers(engine_probe, tiny_models):
    """The smaller load-time check (rows finite and alike batched and alone) runs without loading transformers, and
    says so; the engine then scores as transformers would have."""
    ids, values, reason, loaded, _ = engine_probe
    assert not loaded and "finite and alike batched and alone" in reason and "no transformers reference" in reason
    model = hf_model(tiny_models.rm)
    assert values == pytest.approx([direct_score(model, row) for row in ids], abs=ATOL)


def test_a_broken_engine_is_a_dead_replica_not_failed_rows(engine_probe):
    """An in-process engine that breaks fails every row: the rows are not at fault, so the forward raises
    EngineDeadError (the replica then ends and is replaced, as a killed one) instead of failing them one by one."""
    outcome = engine_probe[-1]
    assert outcome.startswith("the vLLM engine of this replica fails on a known-good input too"), outcome
