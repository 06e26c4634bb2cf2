"""verl's trainer on a machine without an accelerator: a ``cpu`` platform for verl 0.9.1 and the workarounds its
trainer needs there (develop and debug an RM set-up on a laptop, then take it to GPUs unchanged).

verl 0.9.1 ships nvidia, npu and rocm platforms only, and ``platform_manager._detect_platform_name`` falls back to
``nvidia`` when none is found: ``get_device_name()`` is then ``cuda`` and ``initialize_global_process_group_ray`` asks
for NCCL. :func:`activate` (run by :mod:`verl_async_rm.plugin` in every process that imports verl) does, where
:func:`accelerator_present` finds nothing:

1. registers ``PlatformCPU`` (:func:`platform_class`) with verl's own ``PlatformRegistry`` (probed after verl's own
   platforms): device ``cpu``, ``torch.cpu`` with no-op memory calls, backend ``gloo``, Ray resource ``GPU`` (verl's
   ``ResourcePoolManager`` hard-codes ``use_gpu=True``: the local cluster gets logical GPUs,
   ``ray.init(num_gpus=N)``), no IPC (verl's weight sync to vLLM then uses shared memory);
2. **process group**: ``verl.utils.distributed.initialize_global_process_group_ray``, called by verl's engine workers
   without a backend, would build ``"cpu:gloo,cpu:gloo"``, which torch refuses ("Duplicate device type cpu"): its
   default backend becomes ``gloo``;
3. **training engine**: verl registers ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` for cuda and npu only
   (``EngineRegistry.register``); the same classes run on CPU, so they are registered for ``cpu`` too;
4. **reference model**: ``FSDPEngine._build_fsdp_module`` gives every forward-only FSDP2 engine (the reference)
   ``CPUOffloadPolicy(pin_memory=True)``, and a CPU build of torch refuses ``pin_memory()`` ("Cannot access
   accelerator device"): on CPU the policy does not pin;
5. **vLLM's CPU build keeps the linear weights**: ``UnquantizedLinearMethod.process_weights_after_loading`` calls
   ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, which drops ``layer.weight`` after packing it, so
   verl's weight sync (``vLLMColocateWorkerExtension.update_weights_from_ipc`` -> ``model.load_weights``) fails with
   "'Parameter' object has no attribute 'weight_loader'". The weight is kept (as vLLM already does for embeddings);
   vLLM's own ``process_weights_after_loading``, which verl calls after the sync, packs the new weights.

Nothing of verl's or vLLM's installed files is changed: 2-5 replace a default, add a registration, or replace a module
attribute, each when its module is imported (:func:`verl_async_rm.plugin.after_import`). ``VERL_PLATFORM`` (verl's
own override) wins: ``VERL_PLATFORM=cpu`` activates this module anywhere (e.g. a CUDA build of torch on a machine with
an NVIDIA driver but no usable GPU), any other value leaves verl alone.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PLATFORM_NAME", "accelerator_present", "activate", "is_active", "platform_class"]

#: The name this platform is registered under (and ``VERL_PLATFORM``'s value that forces it).
PLATFORM_NAME = "cpu"
#: Where the NVIDIA kernel driver shows itself on Linux, in every process and container, whatever
#: ``CUDA_VISIBLE_DEVICES`` says (a CPU-only Ray actor on a GPU machine sees no CUDA device but still sees this).
NVIDIA_DRIVER_PATH = "/proc/driver/nvidia"

_active = False


def accelerator_present(nvidia_driver_path: str = NVIDIA_DRIVER_PATH) -> str | None:
    """Why this machine has an accelerator verl can use (then the CPU platform stays off), or None."""
    import torch

    if torch.cuda.is_available():
        return "torch.cuda.is_available()"
    if torch.version.hip is not None:
        return f"a ROCm build of torch ({torch.__version__})"
    if hasattr(torch, "npu"):
        return "torch_npu is loaded"
    if os.path.exists(nvidia_driver_path):
        return f"an NVIDIA driver is loaded ({nvidia_driver_path})"
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is on PATH"
    return None


def is_active() -> bool:
    """Whether :func:`activate` registered the CPU platform in this process."""
    return _active


def activate(after_import: Callable[[str, Callable[[Any], None]], None]) -> bool:
    """Register the CPU platform and schedule the workarounds (module doc) where the machine has no accelerator, or
    ``VERL_PLATFORM=cpu``. ``after_import(module_name, fn)`` runs ``fn(module)`` once that module is imported (now if
    it is already). Returns whether the platform is active. Idempotent; needs ``verl.plugin.platform`` importable."""
    global _active
    if _active:
        return True
    forced = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if forced and forced != PLATFORM_NAME:
        return False
    if not forced:
        reason = accelerator_present()
        if reason is not None:
            logger.debug("verl_async_rm: %s, the CPU platform stays off", reason)
            return False
    from verl.plugin.platform import PlatformRegistry
    from verl.plugin.platform import platform_manager

    PlatformRegistry.register(platform=PLATFORM_NAME)(platform_class())
    current = platform_manager._current_platform
    if current is not None and current.device_name != PLATFORM_NAME:
        # resolved before this registration (verl's fallback to nvidia on a CPU machine): correct it
        platform_manager.set_platform(platform_class()())
    after_import("verl.utils.distributed", _gloo_process_group)
    after_import("verl.workers.engine.fsdp.transformer_impl", _fsdp_engine_on_cpu)
    after_import("vllm.model_executor.layers.utils", _keep_cpu_linear_weights)
    _active = True
    logger.debug("verl_async_rm: verl's CPU platform is active (no accelerator here)")
    return True


#: The CUDA-style calls verl makes on ``get_torch_device()`` that ``torch.cpu`` lacks, and what each returns on CPU.
_CPU_NO_OPS = {"empty_cache": None, "ipc_collect": None, "reset_peak_memory_stats": None,
               "set_per_process_memory_fraction": None, "memory_allocated": 0, "memory_reserved": 0,
               "max_memory_allocated": 0, "max_memory_reserved": 0, "get_device_name": "CPU"}
#: Those that ``torch``'s own function of this name does for the CPU (its default generator).
_CPU_TORCH = {"get_rng_state": "get_rng_state", "set_rng_state": "set_rng_state", "manual_seed": "manual_seed",
              "manual_seed_all": "manual_seed"}


class _CPUDevice:
    """``torch.cpu`` plus the CUDA-style calls verl makes on ``get_torch_device()`` (``TrainingWorker`` and
    ``aggressive_empty_cache`` ask for memory sizes, cache flushes and the RNG): no-ops, zero, the host's memory,
    or torch's CPU generator."""

    def __getattr__(self, name: str) -> Any:
        import torch

        if name in _CPU_NO_OPS:
            return lambda *args, **kwargs: _CPU_NO_OPS[name]
        return getattr(torch, _CPU_TORCH[name]) if name in _CPU_TORCH else getattr(torch.cpu, name)

    def mem_get_info(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        import psutil

        memory = psutil.virtual_memory()
        return memory.available, memory.total


@functools.cache
def platform_class() -> type:
    """The ``PlatformCPU`` class (a ``verl.plugin.platform.PlatformBase``), built on first use: this module is imported
    by the entry point while verl itself is being imported, so it cannot import verl's base class at its top."""
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform for a machine with no accelerator (module doc, item 1)."""

        _device = _CPUDevice()

        def _nothing(self, *args: Any, **kwargs: Any) -> None:
            """The device calls that have nothing to do on the host (one device, no cache, no profiler, no CUDA)."""

        set_device = synchronize = set_allocator_settings = empty_cache = _nothing
        profiler_start = profiler_stop = cudart = _nothing

        @property
        def device_name(self) -> str:
            return PLATFORM_NAME

        vendor_name = device_name

        @property
        def device_module(self) -> Any:
            return self._device

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return accelerator_present() is None

        def current_device(self) -> str:
            return "cpu"  # what torch.cpu.current_device() returns; verl passes it to .to(...)

        def device_count(self) -> int:
            return 1

        def manual_seed(self, seed: int) -> None:
            import torch

            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # Ray sets it for logical GPUs; nothing reads it on CPU

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def ray_resource_name(self) -> str:
            return "GPU"  # verl's pools and its resource check count "GPU": the cluster advertises logical GPUs

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False  # verl's weight sync to vLLM falls back to shared memory

    return PlatformCPU


def _gloo_process_group(module: Any) -> None:
    """Item 2: ``initialize_global_process_group_ray(timeout_second=None, backend=None)`` defaults to ``gloo``."""
    module.initialize_global_process_group_ray.__defaults__ = (None, "gloo")


def _fsdp_engine_on_cpu(module: Any) -> None:
    """Items 3 and 4: verl's FSDP engines registered for ``cpu``; forward-only FSDP2 engines offload without
    pinning."""
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine in (("language_model", module.FSDPEngineWithLMHead),
                               ("value_model", module.FSDPEngineWithValueHead)):
        registered = EngineRegistry._engines.get(model_type, {})
        missing = [b for b in ("fsdp", "fsdp2") if PLATFORM_NAME not in registered.get(b, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device=PLATFORM_NAME)(engine)
    base = module.CPUOffloadPolicy
    if base is None or getattr(base, "_verl_async_rm_no_pin", False):
        return

    class CPUOffloadPolicy(base):
        """torch's ``CPUOffloadPolicy`` that never pins host memory (a CPU build of torch cannot)."""

        _verl_async_rm_no_pin = True

        def __init__(self, pin_memory: bool = True) -> None:
            super().__init__(pin_memory=False)

    module.CPUOffloadPolicy = CPUOffloadPolicy


def _keep_cpu_linear_weights(module: Any) -> None:
    """Item 5: vLLM's ``dispatch_cpu_unquantized_gemm`` packs a linear layer's weight and keeps the original."""
    original = module.dispatch_cpu_unquantized_gemm
    if getattr(original, "_verl_async_rm_keeps_weight", False):
        return

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        return original(layer, remove_weight=False)

    dispatch_cpu_unquantized_gemm._verl_async_rm_keeps_weight = True  # type: ignore[attr-defined]
    dispatch_cpu_unquantized_gemm.__wrapped__ = original  # type: ignore[attr-defined]
    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
