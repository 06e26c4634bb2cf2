"""``apply_drops`` (``on_error='drop'``, v0): dropped trajectories are masked out and take their group's mean; the
budget is ``check_failures``' (``test_v1_step_end.py``), on both trainers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl_async_rm.integration.drops import apply_drops

pytestmark = pytest.mark.unit

NAN = math.nan


def batch(finals, dropped, last=(2, 1, 3, 0, 2, 2)):
    """A DataProto like verl's v0 output: the reward at each row's last response token, NaN where dropped."""
    from verl import DataProto

    n, width = len(finals), 4
    scores = torch.zeros(n, width)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, (value, end) in enumerate(zip(finals, last[:n], strict=True)):
        scores[i, end] = value
        mask[i, : end + 1] = 1
    return DataProto.from_dict(
        tensors={"rm_scores": scores, "response_mask": mask},
        non_tensors={"rm_dropped": np.array(dropped, dtype=np.float64),
                     "rm_error": np.array(["RewardModelError: boom" if d else "" for d in dropped], dtype=object)},
    )


def test_a_dropped_row_takes_its_group_mean_and_trains_nothing():
    out = batch([1.0, NAN, 3.0, 5.0, NAN, NAN], [0, 1, 0, 0, 1, 1])
    uids = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    assert apply_drops(out, uids=uids) == 3
    finals = out.batch["rm_scores"].sum(dim=-1).tolist()
    assert finals[1] == pytest.approx(2.0)  # mean of rows 0 and 2 (group a)
    assert finals[4] == pytest.approx(5.0)  # its only scored mate
    assert finals[5] == 0.0  # a group with no scored row: masked out entirely, so the value reaches no loss
    assert float(out.batch["rm_scores"][1, 1]) == pytest.approx(2.0)  # at the row's last response token
    assert [int(out.batch["response_mask"][i].sum()) for i in range(6)] == [3, 0, 4, 1, 0, 0]
    assert not torch.isnan(out.batch["rm_scores"]).any()


def test_without_uids_the_whole_batch_is_the_group():
    out = batch([1.0, NAN, 3.0], [0, 1, 0])
    assert apply_drops(out) == 1
    assert out.batch["rm_scores"].sum(dim=-1).tolist()[1] == pytest.approx(2.0)


def test_the_columns_are_assigned_whole_not_edited_in_place():
    """A ``DataProto`` view may hand out copies of its columns (verl's NeoProto): an edit in place would be lost."""
    out = batch([1.0, NAN, 3.0], [0, 1, 0])
    scores, mask = out.batch["rm_scores"], out.batch["response_mask"]
    apply_drops(out)
    assert out.batch["rm_scores"] is not scores and out.batch["response_mask"] is not mask
    assert torch.isnan(scores).any() and int(mask[1].sum()) > 0  # the old tensors were not touched


def test_nothing_dropped_changes_nothing():
    out = batch([1.0, 2.0], [0, 0])
    before = out.batch["rm_scores"].clone()
    assert apply_drops(out) == 0
    assert torch.equal(out.batch["rm_scores"], before)
