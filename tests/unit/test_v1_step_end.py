"""The v1 step end without Ray: the per-phase records, ``on_error`` at a step's end, the trainer-mode checks, and the
wrappers of verl's ``PPOTrainer.step`` / ``_validate`` (inert unless the trainer's manager is the plugin's)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from verl_async_rm.errors import RMScoreError, TrajectoryDroppedError
from verl_async_rm.integration.drops import check_failures
from verl_async_rm.integration.drops import Failure, PhaseRecord, PhaseRecords
from verl_async_rm.service.batcher_stats import StepStats
from verl_async_rm.service.metrics import service_step_metrics, step_metrics

pytestmark = pytest.mark.unit


def _records_with(scored: int, failed: int, phase: str = "train") -> PhaseRecords:
    records = PhaseRecords()
    for i in range(scored + failed):
        if i < scored:
            records.scored(phase)
        else:
            records.failed(phase, Failure(f"u{i}/0", 3, f"NonFiniteScoreError: nan {i}"))
    return records


def test_the_records_keep_phases_apart_and_pop_starts_a_phase_again():
    records = _records_with(3, 1)
    records.scored("val")
    train = records.pop("train")
    assert (train.requests, train.scored, train.failed) == (4, 3, 1)
    assert str(train.failures[0]) == "trajectory u3/0 (step 3): NonFiniteScoreError: nan 3"
    assert records.pop("train") == PhaseRecord()
    assert (records.pop("val").requests, records.pop("val").requests) == (1, 0)


def test_records_of_several_workers_add_up_and_keep_only_the_first_failures():
    records = [_records_with(2, 20).pop("train") for _ in range(3)]
    total = PhaseRecord().merge(records[0]).merge(records[1]).merge(records[2])
    assert (total.requests, total.scored, total.failed) == (66, 6, 60)
    assert len(total.failures) == 32 and total.failures[0] == records[0].failures[0]


RAISE = SimpleNamespace(on_error="raise", drop_budget=0.05)
DROP = SimpleNamespace(on_error="drop", drop_budget=0.25)


def test_raise_stops_on_one_failure_naming_the_trajectory_and_its_cause():
    check_failures(_records_with(4, 0).pop("train"), RAISE, "step 3")  # nothing failed: nothing raised
    with pytest.raises(RMScoreError, match=r"1 of 5 trajectories of step 3 got no RM score .*trajectory u4/0 "
                                           r"\(step 3\): NonFiniteScoreError: nan 4"):
        check_failures(_records_with(4, 1).pop("train"), RAISE, "step 3")


def test_drop_goes_on_within_the_budget_and_stops_past_it(caplog):
    with caplog.at_level(logging.WARNING):
        check_failures(_records_with(3, 1).pop("train"), DROP, "step 3")  # 1 of 4 = the budget
    assert "1 of 4 trajectories of step 3 dropped" in caplog.text
    with pytest.raises(TrajectoryDroppedError, match=r"2 of 5 trajectories of step 3 .*drop_budget=0.25"):
        check_failures(_records_with(3, 2).pop("train"), DROP, "step 3")


def test_trajectory_counts_come_from_the_phase_record_and_take_the_prefix():
    batcher = StepStats(submitted=9, completed=9, failed=0, timed_out=0, batches=3, tail_s=0.2)
    record = _records_with(5, 1).pop("train")
    service = service_step_metrics(batcher)
    metrics = step_metrics(service, record, prefix="val-async_rm/")
    assert metrics["val-async_rm/requests"] == 6 and metrics["val-async_rm/scored"] == 5
    assert metrics["val-async_rm/errors"] == 1 and metrics["val-async_rm/batches"] == 3
    assert step_metrics(service)["async_rm/requests"] == 9  # v0: the service's own counts


def _v1_config(mode: str, refill: bool = False):
    from omegaconf import OmegaConf

    sampler = {"sync_refill_failed_groups": refill}
    return OmegaConf.create({"trainer": {"v1": {"trainer_mode": mode, "sampler": sampler}}})


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_every_v1_trainer_mode_of_verl_works_under_raise(mode):
    from verl_async_rm.integration.checks import check_v1_trainer

    assert check_v1_trainer(_v1_config(mode), "raise") == mode


def test_drop_needs_refills_only_on_the_sync_trainer_mode():
    from verl_async_rm.integration.checks import check_v1_trainer

    with pytest.raises(ValueError, match=r"on_error=drop with trainer.v1.trainer_mode=sync needs "
                                         r"trainer.v1.sampler.sync_refill_failed_groups=True"):
        check_v1_trainer(_v1_config("sync"), "drop")
    assert check_v1_trainer(_v1_config("sync", refill=True), "drop") == "sync"
    assert check_v1_trainer(_v1_config("colocate_async"), "drop") == "colocate_async"  # async modes refill anyway


def test_a_mode_verl_does_not_ship_is_logged(caplog):
    from verl_async_rm.integration.checks import check_v1_trainer

    with caplog.at_level(logging.WARNING):
        assert check_v1_trainer(_v1_config("my_mode"), "raise") == "my_mode"
    assert "trainer.v1.trainer_mode=my_mode is not one of verl 0.9.1's modes" in caplog.text


class _Recorder:
    """A manager with the plugin's close method: records what the wrappers ask of it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.error = error

    def async_rm_close(self, phase, global_steps):
        self.calls.append((phase, global_steps))
        if self.error is not None:
            raise self.error
        return {("async_rm/" if phase == "train" else "val-async_rm/") + "requests": 4.0}


@pytest.fixture
def wrapped_trainer():
    """verl's real PPOTrainer class, wrapped by install(); an instance built without its GPU set-up."""
    from verl.trainer.ppo.v1 import PPOTrainerSync
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from verl_async_rm.integration import trainer_hooks

    found = PPOTrainer.step, PPOTrainer._validate
    originals = tuple(getattr(f, "__async_rm_wrapped__", f) for f in found)  # a manager built earlier may have wrapped
    PPOTrainer.step, PPOTrainer._validate = originals
    trainer_hooks.install()
    trainer_hooks.install()  # idempotent: wrapped once
    assert PPOTrainer.step.__async_rm_wrapped__ is originals[0]

    class Trainer(PPOTrainerSync):  # verl's sync mode; only what the wrapped methods themselves read
        def _step_once(self, metrics, timing_raw, sample_batch_size):
            if self.fail_with is not None:
                raise self.fail_with
            metrics["actor/loss"] = 1.0
            return SimpleNamespace(keys=["k"], tags=[{}], partition_id="train")

    trainer = object.__new__(Trainer)
    trainer.config = SimpleNamespace(data=SimpleNamespace(train_batch_size=2))
    trainer.parameter_sync_step, trainer.global_steps, trainer.fail_with = 1, 7, None
    trainer.prepare_step = lambda: {}
    try:
        yield trainer
    finally:
        PPOTrainer.step, PPOTrainer._validate = found


def test_the_wrapped_step_adds_the_managers_metrics_at_the_steps_number(wrapped_trainer):
    trainer = wrapped_trainer
    trainer.agent_loop_manager = _Recorder()
    metrics: dict = {}
    trainer.step(metrics, {})
    assert metrics["async_rm/requests"] == 4.0 and metrics["actor/loss"] == 1.0
    assert trainer.agent_loop_manager.calls == [("train", 7)]


@pytest.mark.parametrize("manager", [None, SimpleNamespace(generate_sequences=lambda prompts: None)])
def test_the_wrapped_step_is_inert_without_the_plugins_manager(wrapped_trainer, manager):
    trainer = wrapped_trainer
    trainer.agent_loop_manager = manager
    metrics: dict = {}
    trainer.step(metrics, {})
    assert metrics == {"actor/loss": 1.0}


def test_an_rm_failure_is_raised_from_verls_own_error(wrapped_trainer):
    trainer = wrapped_trainer
    trainer.fail_with = RuntimeError("Sync replay buffer selected terminal groups with no materializable trajectories")
    trainer.agent_loop_manager = _Recorder(RMScoreError("trajectory u/0 got no RM score"))
    with pytest.raises(RMScoreError, match="u/0") as info:
        trainer.step({}, {})
    assert isinstance(info.value.__context__, RuntimeError)
    trainer.agent_loop_manager = _Recorder()  # no RM failure: verl's error is the one raised
    with pytest.raises(RuntimeError, match="no materializable trajectories"):
        trainer.step({}, {})


def test_a_failure_names_the_remote_error_not_rays_wrapper():
    import ray

    from verl_async_rm.errors import RequestTimeoutError
    from verl_async_rm.errors import remote_cause
    from verl_async_rm.integration.agent_loop_worker import _describe

    remote = ray.exceptions.RayTaskError("submit", "Traceback (most recent call last): ...",
                                         RequestTimeoutError("RM replica did not score a batch of 2"))
    for err in (remote, remote.as_instanceof_cause()):
        assert _describe(remote_cause(err)) == "RequestTimeoutError: RM replica did not score a batch of 2"
        assert type(remote_cause(err)) is RequestTimeoutError  # the service's own exception, not Ray's wrapper
    assert _describe(remote_cause(ValueError("x" * 600))) == ("ValueError: " + "x" * 600)[:500]


def test_verls_fit_loop_still_logs_what_step_and_validate_return_at_the_steps_number():
    """Pins the verl 0.9.1 fit loop the hooks rely on (trainer/ppo/v1/trainer_base.py fit): if verl changes it, the
    async_rm/* metrics may stop reaching its tracker, and this test says where to look."""
    import inspect

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    fit = inspect.getsource(getattr(PPOTrainer.fit, "__async_rm_wrapped__", PPOTrainer.fit))
    order = ["val_metrics = self._validate()", "self.logger.log(data=val_metrics, step=self.global_steps)",
             "batch = self.step(metrics, self.timing_raw)", "val_metrics: dict = self._validate()",
             "metrics.update(val_metrics)", "self.logger.log(data=metrics, step=self.global_steps)"]
    positions = [fit.find(line) for line in order]
    assert -1 not in positions and positions == sorted(positions), dict(zip(order, positions, strict=True))


def test_the_wrapped_step_hooks_verls_own_phase_hooks_rm_after_rollout(wrapped_trainer):
    """verl's sync trainer sleeps its rollout in ``on_sample_end`` and wakes it in ``on_step_end``; once a step has run
    through the wrapper, the RM's sleep follows the rollout's, and its wake follows the rollout's."""
    calls = []
    trainer = wrapped_trainer
    trainer.agent_loop_manager = _Recorder()
    trainer.agent_loop_manager.async_rm_sleep = lambda: calls.append("rm sleep")
    trainer.agent_loop_manager.async_rm_wake = lambda: calls.append("rm wake")
    trainer.checkpoint_manager = SimpleNamespace(sleep_replicas=lambda: calls.append("rollout sleep"),
                                                 update_weights=lambda step: calls.append("rollout wake"))
    trainer.curr_step_profile, trainer.timing_raw = False, {}
    trainer.step({}, {})
    trainer.on_sample_end()
    trainer.on_step_end()
    assert calls == ["rollout sleep", "rm sleep", "rollout wake", "rm wake"]
