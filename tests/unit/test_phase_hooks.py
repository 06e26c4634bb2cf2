"""``trainer_hooks.hook_phases``: the trainer's own ``on_sample_end`` / ``on_step_end`` run first, then the manager's
sleep (after the step's last sampling only) and wake; idempotent; silent without the plugin's manager."""

from __future__ import annotations

import pytest

from verl_async_rm.integration.trainer_hooks import SLEEP_METHOD, WAKE_METHOD, hook_phases

pytestmark = pytest.mark.unit


class Manager:
    def __init__(self, calls):
        self.calls = calls

    def async_rm_sleep(self):
        self.calls.append("rm sleep")

    def async_rm_wake(self):
        self.calls.append("rm wake")


class Trainer:
    """The two hooks as verl's sync trainer has them (it sleeps and wakes its rollout there)."""

    def __init__(self, calls, manager=True):
        self.calls = calls
        if manager:
            self.agent_loop_manager = Manager(calls)

    def on_sample_end(self):
        self.calls.append("rollout sleep")

    def on_step_end(self):
        self.calls.append("rollout wake")


def test_the_rm_sleeps_after_the_rollout_and_wakes_after_it():
    calls = []
    trainer = Trainer(calls)
    hook_phases(trainer)
    hook_phases(trainer)  # a second call changes nothing
    trainer.on_sample_end()
    trainer.on_step_end()
    assert calls == ["rollout sleep", "rm sleep", "rollout wake", "rm wake"]
    assert (SLEEP_METHOD, WAKE_METHOD) == ("async_rm_sleep", "async_rm_wake")


def test_with_several_local_updates_only_the_last_sampling_sleeps_the_rm():
    calls = []
    trainer = Trainer(calls)
    trainer.parameter_sync_step = 2
    hook_phases(trainer)
    trainer.local_trigger_step = 0
    trainer.on_sample_end()
    assert calls == ["rollout sleep"]  # the step's second mini-batch may still need scores
    trainer.local_trigger_step = 1
    trainer.on_sample_end()
    assert calls == ["rollout sleep", "rollout sleep", "rm sleep"]


def test_without_the_plugins_manager_only_verls_hooks_run():
    calls = []
    trainer = Trainer(calls, manager=False)
    hook_phases(trainer)
    trainer.on_sample_end()
    trainer.on_step_end()
    assert calls == ["rollout sleep", "rollout wake"]
