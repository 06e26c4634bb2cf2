"""verl's CPU platform (``verl_async_rm.cpu_platform``): on where there is no accelerator, off (verl unchanged) where
there is one, and each workaround doing what it says against the real torch, verl and vLLM.

Each case runs in a fresh interpreter (``import verl`` loads the plugin's entry point, which decides once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

_FACTS = """
import json, os, sys
{before}
import verl
from verl.plugin.platform import PlatformRegistry, get_platform
from verl.utils import device
import verl.utils.distributed as dist
from verl_async_rm import cpu_platform
facts = {{
    "active": cpu_platform.is_active(),
    "registered": list(PlatformRegistry.registered_names()),
    "device_name": device.get_device_name(),
    "backend": device.get_nccl_backend(),
    "resource": device.get_resource_name(),
    "group_defaults": list(dist.initialize_global_process_group_ray.__defaults__),
}}
{after}
print(json.dumps(facts))
"""

#: What a GPU machine looks like to torch, on this CPU machine: CUDA reported available.
_CUDA_AVAILABLE = "import torch\ntorch.cuda.is_available = lambda: True"


def _facts(before: str = "", after: str = "", **env: str) -> dict:
    code = _FACTS.format(before=before, after=after)
    full_env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**full_env, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _accelerator() -> str | None:
    from verl_async_rm.cpu_platform import accelerator_present

    return accelerator_present()


#: The tests that check the platform on: they need a machine without accelerator (CI, a laptop).
needs_no_accelerator = pytest.mark.skipif("_accelerator() is not None", reason="this machine has an accelerator")


def test_an_nvidia_driver_counts_as_an_accelerator(tmp_path):
    """A CPU-only Ray actor on a GPU machine sees no CUDA device, but the driver is there: the platform stays off."""
    from verl_async_rm.cpu_platform import accelerator_present

    (tmp_path / "nvidia").mkdir()
    assert accelerator_present(str(tmp_path / "nvidia")) == f"an NVIDIA driver is loaded ({tmp_path / 'nvidia'})"


_WORKAROUNDS = """
import torch, torch.distributed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"], RANK="0", WORLD_SIZE="1")
dist.initialize_global_process_group_ray()  # as verl's engine workers call it: no backend
facts["process_group_backend"] = torch.distributed.get_backend()
from verl.workers.engine.base import EngineRegistry
import verl.workers.engine.fsdp.transformer_impl as impl
facts["engines"] = [EngineRegistry.get_engine_cls(m, b).__name__ for m in ("language_model", "value_model")
                    for b in ("fsdp", "fsdp2")]
from torch.distributed.fsdp import fully_shard
module = torch.nn.Linear(4, 4)
fully_shard(module, offload_policy=impl.CPUOffloadPolicy(pin_memory=True))  # what verl gives the reference
facts["offloaded_forward"] = list(module(torch.ones(1, 4)).shape)
dev = device.get_torch_device()
dev.empty_cache(); dev.reset_peak_memory_stats()
free, total = dev.mem_get_info()
facts["memory"] = [dev.memory_allocated(), free > 0, total >= free]
facts["ipc"] = get_platform().is_ipc_supported()
torch.distributed.destroy_process_group()
"""


@needs_no_accelerator
def test_on_a_machine_without_accelerator_verl_gets_the_cpu_platform_and_every_workaround(unused_port):
    facts = _facts(after=_WORKAROUNDS, TEST_PORT=str(unused_port))
    assert facts["active"] is True and facts["registered"][-1] == "cpu"
    assert (facts["device_name"], facts["backend"], facts["resource"]) == ("cpu", "gloo", "GPU")
    assert facts["group_defaults"] == [None, "gloo"]
    # verl's own call, no backend given: a gloo group (verl alone builds "cpu:gloo,cpu:gloo", which torch refuses)
    assert facts["process_group_backend"] == "gloo"
    assert facts["engines"] == ["FSDPEngineWithLMHead"] * 2 + ["FSDPEngineWithValueHead"] * 2
    # the reference's FSDP2 offload without pinning: pin_memory() raises on a CPU build of torch
    assert facts["offloaded_forward"] == [1, 4]
    assert facts["memory"] == [0, True, True] and facts["ipc"] is False


@needs_no_accelerator
def test_verl_alone_refuses_what_the_workarounds_fix(unused_port):
    """Control: without the plugin (``VERL_USE_EXTERNAL_PLUGINS=none``) verl falls back to its nvidia platform, and
    the pinned offload torch refuses on CPU is what verl asks for."""
    facts = _facts(after="""
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"], RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
try:
    fully_shard(torch.nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(pin_memory=True))
    facts["pinned"] = "ok"
except RuntimeError as err:
    facts["pinned"] = str(err)
torch.distributed.destroy_process_group()
""", VERL_USE_EXTERNAL_PLUGINS="none", TEST_PORT=str(unused_port))
    assert facts["active"] is False and "cpu" not in facts["registered"]
    assert (facts["device_name"], facts["backend"]) == ("cuda", "nccl")
    assert facts["pinned"] == "Cannot access accelerator device when none is available."


def test_with_cuda_available_verl_is_unchanged():
    """On a GPU machine (CUDA reported available) the platform is not registered and nothing of verl's is touched:
    verl's own nvidia platform, NCCL, the process group's default, the engines as verl registers them."""
    facts = _facts(before=_CUDA_AVAILABLE, after="""
from verl.workers.engine.base import EngineRegistry
import verl.workers.engine.fsdp.transformer_impl as impl
facts["cpu_engines"] = [b for b, devices in EngineRegistry._engines["language_model"].items() if "cpu" in devices]
facts["offload_policy"] = impl.CPUOffloadPolicy.__module__
""")
    assert facts["active"] is False and "cpu" not in facts["registered"]
    assert (facts["device_name"], facts["backend"], facts["resource"]) == ("cuda", "nccl", "GPU")
    assert facts["group_defaults"] == [None, None]
    assert facts["cpu_engines"] == [] and facts["offload_policy"].startswith("torch.")


@needs_no_accelerator
@pytest.mark.parametrize(("forced", "active"), [("nvidia", False), ("cpu", True)])
def test_verl_platform_env_wins(forced, active):
    """verl's own override: ``VERL_PLATFORM=cpu`` turns the platform on even with CUDA available; any other value
    leaves verl alone on a machine without accelerator."""
    facts = _facts(before=_CUDA_AVAILABLE if forced == "cpu" else "", VERL_PLATFORM=forced)
    assert facts["active"] is active
    assert facts["device_name"] == ("cpu" if active else "cuda")


@needs_no_accelerator
def test_vllm_keeps_the_linear_weights_for_verls_weight_sync():
    """vLLM's CPU build drops a linear layer's weight once packed; with the plugin loaded (any process that imports
    verl) it keeps it, so verl's weight sync can load new values into it; the packed forward is unchanged."""
    from verl_async_rm.vllm_cpu import vllm_unavailable_reason

    if vllm_unavailable_reason():
        pytest.skip(vllm_unavailable_reason())
    code = """
import json, torch
import vllm.model_executor.layers.utils as utils
original = utils.dispatch_cpu_unquantized_gemm
import verl  # loads the plugin's entry point
out = {}
for name, dispatch in (("vllm", original), ("plugin", utils.dispatch_cpu_unquantized_gemm)):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(3, 64)
    expected = layer(x)
    dispatch(layer, remove_weight=True)
    out[name] = [layer.weight.numel(), float((layer.cpu_linear(x, layer.weight, None) - expected).abs().max())]
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["vllm"][0] == 0  # what verl's weight sync trips over
    assert out["plugin"][0] == 64 * 32
    assert out["plugin"][1] < 1e-4 and out["vllm"][1] < 1e-4


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
