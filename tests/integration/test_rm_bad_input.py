"""Bad input that needs Ray: the RM worker group's real start-up (``create_rm_worker_group``) on a local cluster.

Complements tests/integration/test_rm_worker_group.py (which calls the pool directly for missing GPUs / nodes and a
placement timeout, and covers a missing RM directory): here the group is asked for more CPU replicas than the
cluster has, and a causal LM is given as the RM; both stop start-up with the clear error, nothing is left reserved.

The module sorts after test_manager_*.py on purpose: their shutdown test expects every ``verl_async_rm_pool``
placement group in the cluster table to be CREATED, and a released pool stays there as REMOVED.
"""

from __future__ import annotations

import pytest
from ray.util.placement_group import placement_group_table

from verl_async_rm.errors import ResourcePoolError, RewardModelError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.placement import create_rm_worker_group, RMResourcePool

pytestmark = pytest.mark.integration


def _live_placement_groups() -> set[str]:
    return {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}


def test_more_replicas_than_the_cluster_has_is_an_error_not_a_hang(ray_local, tiny_models):
    before = _live_placement_groups()
    cfg = RMConfig(
        model_path=str(tiny_models.rm),
        policy_tokenizer_path=str(tiny_models.policy),
        use_gpu=False,
        n_gpus_per_node=64,  # the test cluster has 8 CPUs, one per replica is asked
        nnodes=1,
        placement_timeout_s=30,
    )
    with pytest.raises(ResourcePoolError, match=r"needs 1 node\(s\) with \{CPU: 64\} free each, and 0 node\(s\) "
                       r"have it\. The cluster has: .*Fix: lower reward\.reward_model\.n_gpus_per_node / nnodes"):
        create_rm_worker_group(cfg)
    assert _live_placement_groups() == before


def test_a_causal_lm_as_the_rm_stops_start_up_with_the_reason(ray_local, tiny_models):
    cfg = RMConfig(model_path=str(tiny_models.policy), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False)
    pool = RMResourcePool.from_config(cfg)
    with pytest.raises(RewardModelError, match=r"RM replica 0 failed to load .*architectures=\['Qwen2ForCausalLM'\]"
                       r".*Fix: point the RM path"):
        create_rm_worker_group(cfg, pool=pool)
    assert pool.pgs is None


def test_a_judge_token_of_two_tokens_stops_start_up_naming_judge_tokens(ray_local, tiny_models, tiny_judges):
    cfg = RMConfig(model_path=str(tiny_judges.lm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                   reward_kind="judge", judge_tokens=[" yes", " no"])
    pool = RMResourcePool.from_config(cfg)
    with pytest.raises(RewardModelError, match=r"RM replica 0 failed to load .*judge_tokens=\[' yes', ' no'\]: the "
                       r"judge's tokenizer .* reads ' yes' as 2 tokens.*Fix: list strings that are single tokens"):
        create_rm_worker_group(cfg, pool=pool)
    assert pool.pgs is None
