"""BatchPolicy validation and the argument checks of Batcher (constructor, submit, expect)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from verl_async_rm.service.batcher import Batcher

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.testing.batcher import GatedBatchFn, run_virtual

pytestmark = pytest.mark.unit


def test_defaults_are_valid_and_round_trip():
    policy = BatchPolicy()
    assert policy.max_batch_size >= 1 and BatchPolicy(**dataclasses.asdict(policy)) == policy
    assert BatchPolicy(max_wait_ms=5).max_wait_s == pytest.approx(0.005)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_batch_size", 0, ValueError),
        ("max_batch_size", -3, ValueError),
        ("max_batch_size", 2.5, TypeError),
        ("max_batch_size", True, TypeError),
        ("max_batch_tokens", 0, ValueError),
        ("max_batch_tokens", "many", TypeError),
        ("max_wait_ms", -1, ValueError),
        ("max_wait_ms", math.inf, ValueError),
        ("max_wait_ms", math.nan, ValueError),
        ("max_wait_ms", "10", TypeError),
        ("batch_timeout_s", 0, ValueError),
        ("batch_timeout_s", -1.0, ValueError),
        ("batch_timeout_s", math.inf, ValueError),
        ("group_by_length", "yes", TypeError),
    ],
)
def test_bad_values_name_the_field_the_value_and_a_fix(field, value, error):
    with pytest.raises(error) as info:
        BatchPolicy(**{field: value})
    message = str(info.value)
    assert field in message
    assert repr(value) in message or str(value) in message
    if field != "group_by_length":
        assert any(word in message for word in ("set ", "use ", "give ")), message


def test_policy_is_frozen():
    with pytest.raises(AttributeError):
        BatchPolicy().max_batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("replicas", [0, -1, [], (), "ab", True, 2.0])
def test_batcher_rejects_bad_replicas(replicas):
    with pytest.raises((ValueError, TypeError), match="replicas"):
        Batcher(GatedBatchFn(), replicas=replicas)


def test_batcher_rejects_a_non_callable_batch_fn():
    with pytest.raises(TypeError, match="batch_fn"):
        Batcher("not callable")  # type: ignore[arg-type]


def test_batcher_accepts_replica_objects():
    batcher = Batcher(GatedBatchFn(), BatchPolicy(max_batch_size=3), replicas=["a", "b"])
    assert batcher.policy.max_batch_size == 3
    assert batcher.stats()["replicas"] == 2


def test_submit_and_expect_validate_their_arguments():
    async def main():
        batcher = Batcher(GatedBatchFn(open=True), BatchPolicy(max_batch_tokens=10))
        with pytest.raises(ValueError, match="num_tokens"):
            await batcher.submit("x")
        with pytest.raises(ValueError, match="num_tokens"):
            await batcher.submit("x", num_tokens=-1)
        with pytest.raises(TypeError, match="num_tokens"):
            await batcher.submit("x", num_tokens=True)
        with pytest.raises(TypeError, match="num_tokens"):
            await batcher.submit("x", num_tokens=2.5)
        with pytest.raises(ValueError, match="deadline_s"):
            await batcher.submit("x", num_tokens=1, deadline_s=math.nan)
        for bad in (0, -2, 1.5, True):
            with pytest.raises(ValueError, match="flush_after"):
                batcher.flush_after(bad)
        assert batcher.stats()["submitted"] == 0
        assert await batcher.submit("ok", num_tokens=3) == "ok"
        await batcher.aclose()

    run_virtual(main)


def test_the_batcher_package_imports_without_ray():
    import subprocess
    import sys

    code = "import sys, verl_async_rm.service.batcher; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_virtual_loop_turns_a_hang_into_an_error():
    async def hangs():
        await asyncio.Event().wait()

    with pytest.raises(asyncio.TimeoutError):
        run_virtual(hangs, timeout_s=5.0)
