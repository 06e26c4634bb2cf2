"""Shared fixtures: tiny offline models, local Ray clusters started once per shape and session, tier markers."""

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

#: Ray's daemons poll at intervals meant for a dashboard that the tests do not start: the dashboard agent's node stats
#: and metrics (every 5 s), metric and task-event exports, the autoscaler's loop (every 5 s) and the log monitor's
#: scan of the log folder (every 0.1 s). On this 2-core machine the suite runs two to four clusters at once (the two
#: parts, the demo's and the recipe's runs); idle, each cost 0.27 cores with these defaults and 0.20 without (mean
#: of five runs each, 10 or 30 idle actors, CPU time read from /proc). Nothing the tests check reads them; new
#: workers' logs still reach the driver (found within 2 s). Every Ray process the tests start inherits them (the
#: subprocess runs' clusters too).
RAY_QUIET = {
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "METRICS_RECORD_INTERVAL_S": "60",
    "RAY_enable_metrics_collection": "0",
    "RAY_metrics_report_interval_ms": "60000",
    "RAY_task_events_report_interval_ms": "10000",
    "RAY_event_stats": "0",
    "AUTOSCALER_UPDATE_INTERVAL_S": "60",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
}
for _key, _value in RAY_QUIET.items():
    os.environ.setdefault(_key, _value)

#: Ray starts two idle workers when the first driver connects (a cluster of 8 CPUs here, Ray 2.60), for the first
#: tasks; the tests' and verl's actors start workers of their own and those two stay idle until the cluster stops,
#: each a process that imported Ray (~1 CPU-s). The suite starts a dozen clusters (its own, the program runs').
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

#: vLLM wraps a few sampler helpers in ``torch.compile`` (``compiled_random_sample``, ``batched_count_greater_than``:
#: inductor on CPU) even with ``enforce_eager``: each engine process that samples imports inductor and traces them,
#: and a fresh machine compiles their C++ first. The tests check what is sampled and scored, not how fast: the helpers
#: run eagerly, the same math (another random stream).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

#: One OpenMP thread for torch in the test processes and the programs they start, as Ray already gives its workers
#: (an actor's ``num_cpus``, default 1). The suite keeps more processes busy than this machine has cores; a process
#: with two threads then spins waiting for the one that lost its core: ``test_bench_rm.py`` beside three busy
#: processes took 14.1-14.5 CPU-s with two threads, 8.0-9.8 with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _skip_gpu_tier(items) -> None:
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


#: The Ray cluster shapes the tests use (their modules run together, :data:`ORDER`): a cluster is started once per
#: shape and shared by every module of that shape, not once per module. ``ray_wide`` and ``vllm_ray`` are one shape,
#: so that their modules (in a row) share one cluster, with its TransferQueue, generation server and load balancer;
#: the two names say what each module needs of it.
_WIDE = {"num_cpus": 16, "num_gpus": 2}
CLUSTERS = {
    "ray_local": {"num_cpus": 8, "num_gpus": 0},  # most modules
    "ray_wide": _WIDE,  # room for eight one-replica pools
    "vllm_ray": _WIDE,  # logical GPUs: verl's vLLM rollout and served RM ask for them
}


def ray_cluster(shape: str):
    """The session's local Ray cluster of ``shape`` (a key of :data:`CLUSTERS`), started if the running one (if any)
    has another shape. A module that needs a cluster of its own (``ray.cluster_utils.Cluster``) shuts this one
    down; the next module asking for one starts it again."""
    import ray

    want = CLUSTERS[shape]
    if ray.is_initialized():
        have = ray.cluster_resources()
        if have.get("CPU", 0) == want["num_cpus"] and have.get("GPU", 0) == want["num_gpus"] and \
                len([n for n in ray.nodes() if n["Alive"]]) == 1:
            return ray
        stop_ray()
    if want["num_gpus"]:
        from verl_async_rm.testing.vllm_rollout import set_vllm_env

        set_vllm_env()
    ray.init(address="local", **want, include_dashboard=False, log_to_driver=True, runtime_env=ray_runtime_env(),
             namespace="verl_async_rm_tests")
    return ray


def transfer_queue(config) -> None:
    """verl's TransferQueue (``config.transfer_queue``) on the session's Ray cluster, empty: started by the first v1
    test that asks and kept until the cluster stops (its controller and storage actors take about 9 s of this 2-core
    machine to start), every key the previous user left cleared."""
    import transfer_queue as tq

    tq.init(config.transfer_queue)  # attaches to this cluster's controller when it has one
    empty_transfer_queue()


def empty_transfer_queue() -> None:
    import transfer_queue as tq

    for partition, keys in tq.kv_list().items():
        if keys:
            tq.kv_clear(keys=list(keys), partition_id=partition)


#: Actors the tests of one session cluster share (:func:`manager_cases.generation`), by what they were started with;
#: dropped when the cluster stops.
CLUSTER_SHARED: dict = {}


def stop_ray() -> None:
    """Stop the session's Ray cluster, and TransferQueue's client in this process with it."""
    import ray

    import transfer_queue as tq

    CLUSTER_SHARED.clear()
    tq.close()  # a no-op when not started; else its handles would point into the stopped cluster
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray cluster of 8 logical CPUs and no GPU, shared by every module that asks for it."""
    yield ray_cluster("ray_local")


@pytest.fixture(scope="module")
def ray_wide():
    """A local Ray cluster of 16 logical CPUs (room for eight one-replica pools; the models are tiny), the
    ``vllm_ray`` cluster."""
    yield ray_cluster("ray_wide")


@pytest.fixture(scope="module")
def vllm_ray():
    """A local Ray cluster with 2 logical GPUs (verl's vLLM rollout replica and one served-RM engine)."""
    require_vllm()
    yield ray_cluster("vllm_ray")


def pytest_addoption(parser):
    parser.addoption("--part", choices=("shared", "own"), default=None,
                     help="run only the modules on the session's ray_local cluster (shared), or only the others: the "
                          "unit tier, the modules with a cluster of their own, the program runs, the ray_wide and "
                          "vllm_ray modules, the integration modules with no cluster (own). "
                          "scripts/test.sh runs the two parts at once, in two processes.")


#: The order the modules run in (:func:`pytest_collection_modifyitems`); ``--part shared`` runs the ``ray_local``
#: modules, ``--part own`` the rest, at once (scripts/test.sh). The ``ray_wide`` and ``vllm_ray`` modules run after
#: the program runs are done (their vLLM engines are not beside those of the runs) and beside the last ``ray_local``
#: modules, then the integration modules with no Ray cluster (subprocesses), so that the two parts end together; the
#: two-node module runs last: a ``ray.init()`` with no address (verl's ``main_ppo``) would join its
#: ``ray.cluster_utils`` cluster, were one up at that moment.
ORDER = ("unit", "ray_local", "own_cluster", "program_run", "ray_wide", "vllm_ray", "no_cluster", "two_nodes")
SHARED_PART = ("ray_local",)


def _group(item, clustered: set) -> str:
    """The :data:`ORDER` group of a test; ``clustered``: the paths of the modules with a test on a cluster fixture."""
    if item.path.parent.name == "unit":
        return "unit"
    if "two_nodes" in item.fixturenames:
        return "two_nodes"
    if hasattr(item.module, "program_command"):  # its run started with the session: by now it is done
        return "program_run"
    if item.get_closest_marker("own_cluster"):
        return "own_cluster"
    shapes = [shape for shape in CLUSTERS if shape in item.fixturenames]
    if shapes or item.path in clustered or item.path.parent.name == "gpu":  # the gpu tier: with ray_local
        return max(shapes, key=ORDER.index, default="ray_local")
    return "no_cluster"


def pytest_collection_modifyitems(config, items):
    """Skip the ``gpu`` tier where CUDA is not available. Run the modules in the :data:`ORDER` of their groups: the
    unit tier first (beside the program runs, see :func:`program_runs`), the modules of one cluster shape together so
    that each shape starts once, the modules that read a program run after the runs have had time to finish.
    ``--part`` keeps one of the two parts: the :data:`SHARED_PART` modules, or the rest."""
    clustered = {item.path for item in items if any(shape in item.fixturenames for shape in CLUSTERS)}
    group = {item: _group(item, clustered) for item in items}
    part = config.getoption("part")
    if part is not None:
        keep = [(group[item] in SHARED_PART) == (part == "shared") for item in items]
        config.hook.pytest_deselected(items=[item for item, k in zip(items, keep) if not k])
        items[:] = [item for item, k in zip(items, keep) if k]
    items.sort(key=lambda item: ORDER.index(group[item]))  # stable: the modules' own order is kept within a group
    _skip_gpu_tier(items)


@pytest.fixture(scope="session", autouse=True)
def program_runs(request):
    """The program runs of the collected modules that define ``program_command(request)`` (the demo, the CPU recipe:
    :mod:`program_runs`), started before the first test where vLLM can run, beside the unit tier (which keeps only one
    core busy; their modules run last). Each module's fixture waits for its run with ``program_runs.finish``; a run no
    test waited for is killed at the end."""
    from program_runs import ProgramRuns

    from verl_async_rm.vllm_cpu import vllm_unavailable_reason

    runs = ProgramRuns()
    modules = {item.module.__name__: item.module for item in request.session.items
               if hasattr(item.module, "program_command")}
    if modules and vllm_unavailable_reason() is None:
        from verl_async_rm.demo.data import demo_assets

        demo_assets(request.getfixturevalue("tiny_models").root.parent)  # built once here, not raced by the runs
        for name, module in sorted(modules.items()):
            runs.start(name, module.program_command(request))
    yield runs
    runs.stop_all()


def pytest_sessionfinish(session, exitstatus):
    try:
        import ray

        if ray.is_initialized():
            stop_ray()
    except ImportError:
        pass
