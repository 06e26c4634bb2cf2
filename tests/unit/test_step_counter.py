"""``StepCounter``, the one per-step counter helper: counts since the start and since the last step boundary, by
attribute on a hot path or by a name in a variable; an unknown name is refused."""

from __future__ import annotations

import pytest

from verl_async_rm.step_counter import StepCounter

pytestmark = pytest.mark.unit


def test_counts_since_the_start_and_per_step():
    counts = StepCounter(["submitted", "failed"])
    counts.submitted += 2
    counts.add("failed")
    assert counts.pop_step() == {"submitted": 2, "failed": 1} and counts.pop_step() == {"submitted": 0, "failed": 0}
    counts.add_all({"submitted": 3, "failed": 0.5})
    assert counts.totals() == {"submitted": 5, "failed": 1.5} and counts["submitted"] == 5
    assert counts.pop_step() == {"submitted": 3, "failed": 0.5}


def test_an_unknown_count_is_refused():
    counts = StepCounter(["submitted"])
    with pytest.raises(AttributeError, match="no count 'completed'"):
        counts.add("completed")
    with pytest.raises(KeyError):
        counts["completed"]
