"""``SleepStats``: the step's awake/asleep time split at each step's end, and the sleeps' and wakes' figures."""

from __future__ import annotations

import pytest

from verl_async_rm.service.service import SleepStats

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_awake_and_asleep_is_split_at_each_pop():
    clock = Clock()
    ledger = SleepStats(clock)
    clock.now = 6.0
    ledger.slept(seconds=0.5, moved_bytes=1000)
    clock.now = 10.0  # the step ends while asleep
    first = ledger.pop()
    assert first["rm_awake_s"] == 6.0 and first["rm_asleep_s"] == 4.0 and first["rm_awake_share"] == 0.6
    assert first["sleeps"] == 1 and first["wakes"] == 0 and first["sleep_bytes"] == 1000 and first["sleep_s"] == 0.5
    clock.now = 12.0
    ledger.woke(seconds=0.25, moved_bytes=1000)
    clock.now = 20.0
    second = ledger.pop()
    assert second["rm_asleep_s"] == 2.0 and second["rm_awake_s"] == 8.0
    assert second["wakes"] == 1 and second["sleeps"] == 0 and second["wake_bytes"] == 1000 and second["wake_s"] == 0.25
    assert not ledger.asleep


def test_a_step_without_time_counts_as_awake():
    clock = Clock()
    assert SleepStats(clock).pop()["rm_awake_share"] == 1.0
