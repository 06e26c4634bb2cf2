"""RM replicas larger than one GPU (``+async_rm.gpus_per_replica=2``), on a CPU pool of 4 "GPUs" (CPU bundles).

The pool holds 2 replicas of 2 ranks each: every replica is 2 Ray processes that load the tiny RM sharded over a gloo
group (tensor parallel: its heads and MLP width divide by 2) and score each batch together. Scores equal the
unsharded model's (fp32, 1e-4), and a forward failing on rank 0 alone, or a rank killed in the middle of a batch,
costs no trajectory: the batch is re-queued, and the replica is replaced with all its ranks (one service, both faults
in turn, then a batch on the replaced replica). The keys that cut the pool:
``tests/unit/test_sharded_replica_config.py``; the agent-loop manager's path is the unsharded RM's (every manager
module). Without Ray, two spawned ranks score as the unsharded model by either layout (tensor parallel, FSDP2), and
alike, and so does a ``logits`` judge.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray
from rm_cases import ANSWERS, QUESTIONS, direct_score, hf_model, make_request, wait_stats

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.client import score_with_timeout
from verl_async_rm.service.service import start_rm_service

pytestmark = pytest.mark.integration

HANG_S = 180.0  # hang detector for one wait; a sharded replica loads in ~15 s here


def requests(policy_tok, n: int, tag: str):
    pairs = [(q, a) for q in QUESTIONS for a in ANSWERS]
    return [make_request(policy_tok, *pairs[i % len(pairs)], uid=f"{tag}{i}") for i in range(n)]


FLAKY_RM_CODE = '''
import os

import torch
from transformers import Qwen2ForSequenceClassification


class FlakyQwen2RM(Qwen2ForSequenceClassification):
    """Rank 0 of a sharded replica fails one scoring forward (the first, once per model directory), before the
    forward's first collective: a failure on that rank alone, as an out-of-memory error on one GPU would be."""

    def forward(self, input_ids=None, **kwargs):
        scoring = input_ids is not None and input_ids.numel() > 64  # not the load-time checks' tiny forwards
        if scoring and torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            try:
                open(os.path.join(self.config._name_or_path, "failed_once"), "x").close()
            except FileExistsError:
                pass
            else:
                raise RuntimeError("injected: rank 0 alone ran out of memory")
        return super().forward(input_ids=input_ids, **kwargs)
'''


def flaky_rm(rm_path, out_dir):
    """The tiny RM with :data:`FLAKY_RM_CODE` as its own code (``trust_remote_code``)."""
    import json
    import shutil

    shutil.copytree(rm_path, out_dir)
    (out_dir / "flaky_rm.py").write_text(FLAKY_RM_CODE)
    config = json.loads((out_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForSequenceClassification": "flaky_rm.FlakyQwen2RM"}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def test_a_rank_failing_or_killed_mid_batch_costs_no_trajectory_and_its_replica_is_replaced_whole(
    ray_local, tiny_models, policy_tok, tmp_path
):
    """One service of 2 replicas of 2 ranks (16 per batch and an hour of max_wait: nothing flushes until the 16th
    request arrives), two faults in turn, each costing no trajectory:

    - rank 0's forward fails (:data:`FLAKY_RM_CODE`, once) while its other rank waits in the forward's first
      collective: the replica ends, its batch is re-queued on the other replica, and it is replaced whole. (That
      rank 0 does not retry out of step is the spawned-rank tests' part: on gloo a retry out of step would crash the
      process and end the replica too.)
    - both replicas' rank 1 frozen, the busy replica's rank 1 killed in the middle of the batch: the batch is
      re-queued, the replica (rank 0 too) replaced whole; the next batch scores as the unsharded model."""
    path = flaky_rm(tiny_models.rm, tmp_path / "flaky_rm")
    config = RMConfig(model_path=str(path), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      trust_remote_code=True, n_gpus_per_node=4, gpus_per_replica=2, placement_timeout_s=60,
                      init_timeout_s=120)
    flaky, first, second = requests(policy_tok, 16, "f"), requests(policy_tok, 16, "a"), requests(policy_tok, 16, "b")
    service = start_rm_service(config, BatchPolicy(max_batch_size=16, max_wait_ms=3_600_000),
                               name=f"sharded_{time.monotonic_ns()}")

    async def failing_rank0():
        scores = await asyncio.gather(*(score_with_timeout(service, r, timeout_s=HANG_S) for r in flaky))
        stats = await wait_stats(service, lambda s: s["replicas_replaced_total"] == 1, "the replica replaced")
        return scores, stats, await asyncio.wait_for(service.describe.remote(), 60)

    async def killed_rank1():
        before = await service.describe.remote()
        ranks = {info["ranks"][0]["pid"]: ray.get_actor(info["ranks"][0]["actor_name"]) for info in before}
        for pid in ranks:  # both replicas' rank 1 frozen: whichever rank 0 takes the batch waits for its rank 1
            os.kill(pid, signal.SIGSTOP)
        waiting = [asyncio.ensure_future(score_with_timeout(service, r, timeout_s=HANG_S)) for r in first]
        await wait_stats(service, lambda s: s["in_flight_requests"] == 16, "the batch sent to a replica")
        lost_replica = await busy_replica(before)  # its rank 0 is in the batch, in a collective with its frozen rank 1
        lost_pid = before[lost_replica]["ranks"][0]["pid"]
        ray.kill(ranks[lost_pid], no_restart=True)  # the frozen rank 1 of the busy replica dies mid-batch
        os.kill(next(pid for pid in ranks if pid != lost_pid), signal.SIGCONT)
        scores = await asyncio.gather(*waiting)
        after_loss = await service.stats.remote()
        await wait_stats(service, lambda s: s["replicas_replaced_total"] == 2, "the replica replaced")
        after = await asyncio.wait_for(service.describe.remote(), 60)
        again = await asyncio.gather(*(score_with_timeout(service, r, timeout_s=HANG_S) for r in second))
        return before, lost_replica, scores, after_loss, after, again

    try:
        flaky_scores, flaky_stats, after_flaky = asyncio.run(failing_rank0())
        before, lost_replica, scores, after_loss, after, again = asyncio.run(killed_rank1())
    finally:
        ray.get(service.close.remote(), timeout=HANG_S)
        ray.kill(service)
    model = hf_model(tiny_models.rm)

    assert (path / "failed_once").exists()  # the injected failure did happen
    assert flaky_scores == pytest.approx([direct_score(model, r.prompt_ids + r.response_ids) for r in flaky],
                                         abs=1e-4)
    assert flaky_stats["completed"] == 16 and flaky_stats["failed"] == 0
    assert flaky_stats["requeued"] == 16 and flaky_stats["replicas_lost_total"] == 1
    assert len(after_flaky) == 2 and all(info["sharding"] == "tensor_parallel" for info in after_flaky)

    assert scores == pytest.approx([direct_score(model, r.prompt_ids + r.response_ids) for r in first], abs=1e-4)
    assert after_loss["completed"] == 32 and after_loss["failed"] == 0  # 16 of each fault
    assert after_loss["requeued"] == 32 and after_loss["replicas_lost_total"] == 2
    assert len(before) == 2  # the pool of 4 cut into 2 replicas of 2 ranks, rank 1 a process of its own
    for info in before:
        assert info["gpus_per_replica"] == 2 and info["sharding"] == "tensor_parallel"
        assert [rank["rank"] for rank in info["ranks"]] == [1] and info["ranks"][0]["pid"] != info["pid"]
    replaced = after[lost_replica]
    assert replaced["actor_name"] != before[lost_replica]["actor_name"]
    assert replaced["ranks"][0]["pid"] != before[lost_replica]["ranks"][0]["pid"]
    assert replaced["sharding"] == "tensor_parallel"
    old_rank0 = before[lost_replica]["pid"]
    assert not os.path.exists(f"/proc/{old_rank0}") or _zombie(old_rank0)  # rank 0 ended with its rank
    assert again == pytest.approx([direct_score(model, r.prompt_ids + r.response_ids) for r in second], abs=1e-4)


async def busy_replica(replicas: list[dict]) -> int:
    """The replica whose rank 0 is busy with a batch: the one that does not answer ``describe`` (a one-call actor)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        silent = []
        for i, info in enumerate(replicas):
            try:
                await asyncio.wait_for(ray.get_actor(info["actor_name"]).describe.remote(), 3.0)
            except asyncio.TimeoutError:
                silent.append(i)
        if len(silent) == 1:
            return silent[0]
    raise AssertionError("no single replica was busy with the batch")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] in ("Z", "X")
    except OSError:
        return True


def _rank(rank: int, world: int, port: int, config: RMConfig, work, layout: str, out) -> None:
    """One rank of a sharded replica without Ray (a spawned process): ``work(scorer, rank)``, or its error."""
    import verl_async_rm.scoring.sharding as sharding
    from verl_async_rm.scoring.scorer import RewardModelScorer

    try:
        sharding.sharding_method = lambda model_config, k: (layout, "forced by the test")
        sharding.AGREE_S = 3.0  # a rank whose forward failed alone gives up on the others after 3 s
        store = sharding.host_store(world, 60.0, port)[2] if rank == 0 else None
        group = sharding.ShardGroup(rank, world, "127.0.0.1", port, 60.0)
        scorer = RewardModelScorer(config, shard=group, store=store)
        out.put((rank, scorer.describe()["sharding"], work(scorer, rank)))
        sharding.leave_group()
    except BaseException as err:  # noqa: BLE001 - reported to the test
        out.put((rank, "error", err))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(out, world: int) -> list[tuple]:
    return sorted((out.get(timeout=HANG_S) for _ in range(world)), key=lambda answer: answer[0])


def _stop(processes) -> None:
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def run_ranks(config: RMConfig, work, layout: str = "tensor_parallel", world: int = 2) -> list[tuple]:
    """``work(scorer, rank)`` on ``world`` new spawned ranks of one sharded replica (gloo, no Ray), which end with
    it: each rank's ``(rank, sharding, result)``, sorted by rank. For work that leaves the ranks out of step."""
    import multiprocessing

    port, context = _free_port(), multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, world, port, config, work, layout, out)) for r in range(world)]
    for process in ranks:
        process.start()
    try:
        return _answers(out, world)
    finally:
        _stop(ranks)


def _serve(inbox, out) -> None:
    """A spawned rank kept for several tests: each job forms a new group, runs, and leaves it (error or not)."""
    import verl_async_rm.scoring.sharding as sharding

    for job in iter(inbox.get, None):
        _rank(*job, out)
        sharding.leave_group()


class RankPool:
    """``world`` spawned ranks started once for the module's tests whose ranks stay in step (each spawned rank
    imports torch and transformers: seconds of CPU); :meth:`run` is :func:`run_ranks` on them. A job that does not
    answer in time ends the ranks, and the next job starts new ones."""

    def __init__(self, world: int = 2) -> None:
        self.world, self.ranks, self.inboxes, self.out = world, [], [], None

    def run(self, config: RMConfig, work, layout: str = "tensor_parallel") -> list[tuple]:
        import multiprocessing

        if not self.ranks:
            context = multiprocessing.get_context("spawn")
            self.inboxes, self.out = [context.Queue() for _ in range(self.world)], context.Queue()
            self.ranks = [context.Process(target=_serve, args=(inbox, self.out), daemon=True) for inbox in self.inboxes]
            for process in self.ranks:
                process.start()
        port = _free_port()
        for r, inbox in enumerate(self.inboxes):
            inbox.put((r, self.world, port, config, work, layout))
        try:
            return _answers(self.out, self.world)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        _stop(self.ranks)
        self.ranks, self.inboxes = [], []


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool()
    yield pool
    pool.close()


def rank_config(tiny_models) -> RMConfig:
    return RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False)


class Score:
    """``scorer.score(requests)`` on a rank (picklable for spawned ranks)."""

    def __init__(self, requests: list) -> None:
        self.requests = requests

    def __call__(self, scorer, rank: int) -> list:
        return scorer.score(self.requests)


@pytest.mark.parametrize("layout", ["tensor_parallel", "fsdp2"])
def test_two_ranks_score_as_the_unsharded_model_by_either_layout(ranks, tiny_models, policy_tok, layout):
    """The sharding itself, with two real ranks (gloo) and no Ray: tensor parallel, and FSDP2's per-layer gathers."""
    from verl_async_rm.scoring.scorer import RewardModelScorer

    config = rank_config(tiny_models)
    reqs = requests(policy_tok, 6, "t")
    answers = ranks.run(config, Score(reqs), layout)
    expected = RewardModelScorer(config).score(reqs)
    for rank, sharding, scores in answers:
        assert sharding == layout, scores
        assert scores == pytest.approx(expected, abs=1e-4)
    assert answers[0][2] == answers[1][2]  # every rank ends with the same scores


class PoisonedRows:
    """A micro-batch of token rows whose third row holds an id outside the vocabulary (the embedding raises on every
    rank, before the forward's first collective), scored as the scorer's forwards score a batch."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __call__(self, scorer, rank: int) -> tuple[list, int]:
        vocab = scorer.model.get_input_embeddings().num_embeddings
        rows = [*self.rows[:2], [*self.rows[2][:-1], vocab + 7], *self.rows[3:]]
        values = scorer.engine.score_all(rows, 1 << 20)
        return [v if isinstance(v, float) else type(v).__name__ for v in values], scorer.engine.on_failure.failures


@pytest.mark.parametrize("layout", ["tensor_parallel", "fsdp2"])
def test_a_row_that_fails_on_every_rank_fails_alone_and_the_ranks_stay_in_step(ranks, tiny_models, policy_tok,
                                                                                 layout):
    """A failure every rank meets (a row the model refuses): the ranks agree on it and retry the same halves in step,
    so only that row gets an error and every other row its unsharded score."""
    from verl_async_rm.scoring.scorer import RewardModelScorer

    config = rank_config(tiny_models)
    rows = [r.prompt_ids + r.response_ids for r in requests(policy_tok, 5, "p")]
    answers = ranks.run(config, PoisonedRows(rows), layout)
    plain = RewardModelScorer(config).engine
    expected = [plain.score_batch([row])[0] for row in rows]
    for rank, _, result in answers:
        assert result != "error" and not isinstance(result, BaseException), (rank, result)
        values, failures = result
        assert values[2] == "RewardModelError" and failures >= 2  # the whole batch, then each half that held it
        kept = [i for i in range(len(rows)) if i != 2]
        assert [values[i] for i in kept] == pytest.approx([expected[i] for i in kept], abs=1e-4)
    assert answers[0][2] == answers[1][2]


class FailAlone:
    """The first forward of rank ``failing`` raises at the second decoder layer, after the first layer's collectives:
    the other rank's forward of the same batch is left waiting in a collective of that layer."""

    def __init__(self, requests: list, failing: int) -> None:
        self.requests, self.failing = requests, failing

    def __call__(self, scorer, rank: int) -> list:
        if rank == self.failing:
            def fail_once(module, args):
                handle.remove()
                raise RuntimeError("injected: this rank alone ran out of memory")

            handle = scorer.model.model.layers[1].register_forward_pre_hook(fail_once)
        return scorer.score(self.requests)


@pytest.mark.parametrize("failing", [0, 1], ids=["rank0", "rank1"])
def test_a_forward_that_fails_on_one_rank_only_ends_the_replica_instead_of_retrying_out_of_step(
    tiny_models, policy_tok, failing
):
    """One rank alone fails (as an out-of-memory error on one GPU would): it must not retry the rows in halves while
    the other rank waits inside the forward (their collectives would pair up wrongly: without the agreement, this
    test hangs). Both ranks raise ShardDesyncError, which ends the replica (its batch re-queued), and neither returns
    a score. Rank 0 hosts the group's store, so either rank failing alone is a case of its own."""
    from verl_async_rm.errors import ShardDesyncError

    answers = run_ranks(rank_config(tiny_models), FailAlone(requests(policy_tok, 6, "d"), failing))
    for rank, kind, error in answers:
        assert kind == "error" and isinstance(error, ShardDesyncError), (rank, error)
    assert "failed here" in str(answers[failing][2]) and "injected" in str(answers[failing][2])


class DifferentForwards:
    """Each rank reports a forward path of its own (as ranks whose load-time checks came out differently would)."""

    def __call__(self, scorer, rank: int) -> None:
        from verl_async_rm.scoring.sharding import check_same_forward

        check_same_forward({**scorer.engine.describe(), "packing": f"packed on rank {rank}",
                            "packing_reason": f"reasons may differ in wording ({rank})"})


def test_ranks_that_chose_different_forward_paths_are_refused_on_every_rank(ranks, tiny_models):
    from verl_async_rm.errors import RewardModelError

    answers = ranks.run(rank_config(tiny_models), DifferentForwards())
    for rank, kind, error in answers:
        assert kind == "error" and isinstance(error, RewardModelError), (rank, error)
        assert "chose different forward paths at load" in str(error) and "packed on rank 1" in str(error)
        assert "reasons may differ" not in str(error)  # only the choices are compared


@pytest.mark.parametrize("layout", ["tensor_parallel", "fsdp2"])
def test_a_logits_judge_on_two_ranks_reads_as_the_unsharded_judge(ranks, tiny_models, tiny_judges, policy_tok,
                                                                    layout):
    """A ``logits`` judge is sharded as an outcome RM: its readout (final norm, the judge tokens' LM-head rows, whole
    on every rank) passes the load-time check against the sharded model's own logits and reads as one copy does."""
    from judge_cases import TOKENS

    from verl_async_rm.scoring.scorer import RewardModelScorer

    config = RMConfig(model_path=str(tiny_judges.lm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                      reward_kind="judge", judge_tokens=TOKENS)
    reqs = [make_request(policy_tok, q, a, uid=f"j{i}") for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS))]
    answers = ranks.run(config, Score(reqs), layout)
    expected = RewardModelScorer(config).score(reqs)
    assert max(expected) - min(expected) > 1e-3  # the judge tells the trajectories apart
    for rank, sharding, scores in answers:
        assert sharding == layout, scores
        assert scores == pytest.approx(expected, abs=1e-4)
