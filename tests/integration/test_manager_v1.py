"""AsyncRMAgentLoopManager on verl's v1 (TransferQueue) trainer path: trajectories land in TransferQueue scored."""

from __future__ import annotations

import time

import pytest
import torch
from manager_cases import RM_W, RULE_W, running_manager

pytestmark = pytest.mark.integration

WAIT_S = 240.0


def prompts_td(questions, global_steps: int, first_index: int = 0):
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(
        tensor_dict={
            "uid": [f"s{global_steps}q{first_index + i}" for i in range(len(questions))],
            "raw_prompt": [[{"role": "user", "content": q}] for q in questions],
            "data_source": ["tiny"] * len(questions),
            "reward_model": [{"ground_truth": "42"} for _ in questions],
            "index": torch.arange(first_index, first_index + len(questions)),
        },
        non_tensor_dict={"global_steps": global_steps},
    )


@pytest.fixture(scope="module")
def v1_manager(ray_local, tiny_models):
    import transfer_queue as tq

    with running_manager(ray_local, tiny_models, "v1") as (manager, _):
        yield manager, tq


def wait_finished(tq, uids, partition="train"):
    """Poll TransferQueue's prompt tags until every prompt's agent loops have settled (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        tags = tq.kv_list(partition_id=partition).get(partition, {})
        status = {uid: tags.get(uid, {}).get("status") for uid in uids}
        if all(s in ("finished", "failure") for s in status.values()):
            return status
        time.sleep(0.2)
    raise TimeoutError(f"trajectories did not settle within {WAIT_S}s: {status}")


def test_v1_trajectories_are_scored_in_transfer_queue(v1_manager, tiny_models):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from verl_async_rm.integration.manager import AsyncRMAgentLoopManagerV1

    manager, tq = v1_manager
    assert isinstance(manager, AsyncRMAgentLoopManagerV1)
    questions = ["how many apples are left?", "what is the total cost?", "how fast is the train?"]
    # one step dispatched as two batches (as verl's refills and async modes do): expected counts add up
    first, refill = prompts_td(questions[:2], global_steps=1), prompts_td(questions[2:], global_steps=1, first_index=2)
    uids = list(first["uid"]) + list(refill["uid"])
    manager.generate_sequences(first)
    manager.generate_sequences(refill)
    status = wait_finished(tq, uids)
    assert set(status.values()) == {"finished"}

    keys = [f"{uid}_{session}_0" for uid in uids for session in range(2)]
    data = tq.kv_batch_get(keys=keys, partition_id="train",
                           select_fields=["prompts", "responses", "rm_scores", "extra_fields"])
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_models.rm, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    for i in range(len(keys)):
        prompt, response, rm_scores = data["prompts"][i], data["responses"][i], data["rm_scores"][i]
        info = data["extra_fields"][i]["reward_extra_info"]
        with torch.no_grad():
            ids = torch.cat([prompt, response]).unsqueeze(0)
            direct = float(rm.score(rm.model(input_ids=ids).last_hidden_state)[0, -1, 0])
        rule = (len(tok.decode(response, skip_special_tokens=True)) % 7) / 7.0
        assert info["rm_score"] == pytest.approx(direct, abs=1e-4) and info["rule_score"] == pytest.approx(rule)
        assert float(rm_scores[-1]) == pytest.approx(RM_W * direct + RULE_W * rule, abs=1e-4)
        assert float(rm_scores[:-1].abs().sum()) == 0.0

    # the next step closes this one: its metrics cover all 6 trajectories
    batch2 = prompts_td(["a new question"], global_steps=2)
    manager.generate_sequences(batch2)
    metrics = manager.last_metrics
    assert metrics["async_rm/requests"] == 6 and metrics["async_rm/scored"] == 6 and metrics["async_rm/errors"] == 0
    assert "async_rm/reward_tail_s" in metrics and "async_rm/rm_utilization" in metrics
    assert set(wait_finished(tq, list(batch2["uid"])).values()) == {"finished"}
