"""Shared fixtures: tiny offline models, a local Ray cluster started once per session, tier markers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Modules the Ray workers import by name in tests (custom agent loops, rule functions).
TEST_ASSETS = REPO_ROOT / "tests" / "integration" / "assets"

# Ray workers must import this package by name even when it is not pip-installed.
os.environ.setdefault("PYTHONPATH", str(REPO_ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """Skip the ``gpu`` tier where CUDA is not available (torch is imported only if such tests were collected)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models():
    """The tiny policy / RM / alt-RM built offline (cached in $VERL_ASYNC_RM_CACHE or <repo>/.cache)."""
    from verl_async_rm.testing import build_tiny_models

    cache = os.environ.get("VERL_ASYNC_RM_CACHE") or str(REPO_ROOT / ".cache")
    return build_tiny_models(cache)


@pytest.fixture(scope="session")
def tiny_judges():
    """The tiny judges (causal LMs: ``lm`` for the logits readout, ``digit`` for the generate readout), built offline
    next to the tiny models."""
    from verl_async_rm.testing.judges import build_tiny_judges

    return build_tiny_judges(os.environ.get("VERL_ASYNC_RM_CACHE") or str(REPO_ROOT / ".cache"))


@pytest.fixture(scope="session")
def policy_tok(tiny_models):
    """The tiny policy's tokenizer (ChatML template, pad id 0)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models.policy)


@pytest.fixture(scope="session")
def nan_rm(tiny_models, tmp_path_factory):
    """(path, poisoned token id) of a copy of the tiny RM whose ``</s>`` embedding is NaN: inputs with it score NaN."""
    from rm_cases import save_nan_rm

    return save_nan_rm(tiny_models.rm, tmp_path_factory.mktemp("nan_rm"))


def ray_runtime_env() -> dict:
    """runtime_env that lets Ray workers import this package and keeps them quiet and offline."""
    keys = ("TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VERL_ASYNC_RM_CACHE")
    env = {k: os.environ[k] for k in keys if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), str(TEST_ASSETS), os.environ.get("PYTHONPATH", "")) if p
    )
    return {"env_vars": env}


def require_vllm() -> None:
    """Skip the calling test where vLLM cannot run, saying why; fail instead under ``VERL_ASYNC_RM_REQUIRE_VLLM=1``
    (set by ``.ci/run``), so CI never passes without the vLLM tests."""
    from verl_async_rm.vllm_cpu import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        if os.environ.get("VERL_ASYNC_RM_REQUIRE_VLLM") == "1":
            pytest.fail(f"VERL_ASYNC_RM_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray cluster (8 logical CPUs, no GPU), started on first use and kept for the whole session.

    A test that needs its own cluster (for example a multi-node ``ray.cluster_utils.Cluster``) shuts this one down;
    the next test asking for ``ray_local`` starts it again.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=8,
            num_gpus=0,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env=ray_runtime_env(),
            namespace="verl_async_rm_tests",
        )
    yield ray


def pytest_sessionfinish(session, exitstatus):
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
