"""An RM replica over ``gpus_per_replica=k`` GPUs: ``k`` ranks in their own ``torch.distributed`` group, the RM
sharded (tensor parallel where the architecture has a plan dividing by ``k``, else FSDP2), all scoring the same
requests in step. Retrying a failed micro-batch is safe only when every rank failed (:class:`FailureAgreement`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from verl_async_rm.errors import ConfigValueError, RewardModelError, ShardDesyncError

__all__ = ["ShardGroup", "host_store", "join_group", "sharding_method", "load_sharded", "leave_group",
           "check_replica_memory", "weights_bytes", "WEIGHTS_SHARE", "FailureAgreement", "check_same_forward",
           "AGREE_S", "config_json"]

#: Most of one GPU's memory a replica's share of the weights may take (the rest: activations, the CUDA context).
WEIGHTS_SHARE = 0.9
#: Longest a rank whose forward failed waits for every other rank's forward of the same micro-batch to fail too. The
#: ranks of a failure shared by all stop between the same two collectives, so they report within moments.
AGREE_S = 10.0
_GIB = 1024**3
ELEMENT_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardGroup:
    """This process's place in a sharded replica: ``rank`` of ``world_size``, the store rank 0 hosts, and how long a
    collective (the rendezvous included) may wait for the other ranks."""

    rank: int
    world_size: int
    host: str
    port: int
    timeout_s: float


def host_store(world_size: int, timeout_s: float, port: int = 0) -> tuple[str, int, Any]:
    """Rank 0's ``TCPStore`` on ``port`` (0: a free one) of this node: ``(host, port, store)``; keep ``store``."""
    host = "127.0.0.1"  # a replica's ranks are all on one node (one bundle): the loopback address
    store = torch.distributed.TCPStore(
        host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return host, store.port, store


def join_group(group: ShardGroup, device: torch.device, store: Any = None) -> Any:
    """Initialise this process's default ``torch.distributed`` group (the replica's ranks, each on its own
    ``device``); returns the group's store, which :class:`FailureAgreement` uses."""
    if torch.distributed.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group: one sharded replica per process")
    timeout = timedelta(seconds=group.timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(group.host, group.port, group.world_size, is_master=False, timeout=timeout)
    # transformers' tensor-parallel loader places this rank's shards on <device type>:LOCAL_RANK
    os.environ["LOCAL_RANK"] = str(device.index or 0)
    backend = "gloo" if device.type == "cpu" else "nccl"
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    torch.distributed.init_process_group(
        backend, store=store, rank=group.rank, world_size=group.world_size, timeout=timeout)
    return store


def leave_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class FailureAgreement:
    """The failure hook of a sharded replica's engine: the ``n``-th call of every rank is about one forward; each
    marks its failure in rank 0's store and waits ``AGREE_S`` for every rank's, else ``ShardDesyncError``. Out of band:
    a rank whose forward succeeded may wait in the next collective."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = AGREE_S
        self.failures = 0

    def __call__(self, err: BaseException) -> None:
        if isinstance(err, torch.distributed.DistError):
            raise ShardDesyncError(f"rank {self.rank}: a collective of the sharded replica failed: {err!r}") from err
        self.failures += 1
        key = f"verl_async_rm/failed/{self.failures}/"
        try:
            self.store.set(key + str(self.rank), type(err).__name__)
            self.store.wait([key + str(r) for r in range(self.world_size)], timedelta(seconds=self.timeout_s))
            apart = self.store.check([key + "apart"])
        except Exception:  # noqa: BLE001 - the store's timeout, or the store gone with rank 0
            apart = True
        if apart:
            with contextlib.suppress(Exception):  # a rank that arrives late does not retry either
                self.store.set(key + "apart", str(self.rank))
            raise ShardDesyncError(
                f"rank {self.rank} of {self.world_size}: a forward failed here ({err!r}) but not on every rank of the "
                f"sharded replica within {self.timeout_s:g}s: the ranks are out of step") from err


def check_same_forward(describe: dict[str, Any]) -> None:
    """Refuse ranks that chose different forward paths at load (``describe``: this rank's
    ``TransformersEngine.describe()``):
    they would issue different collectives. Every rank calls it; every rank raises alike."""
    views: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, {k: v for k, v in describe.items() if not k.endswith("_reason")})
    if any(view != views[0] for view in views):
        raise RewardModelError(
            f"the ranks of the sharded replica chose different forward paths at load: {views}; set async_rm.packing "
            "and async_rm.share_prompts explicitly (not 'auto') so that every rank runs the same forwards")


def sharding_method(model_config: Any, world_size: int) -> tuple[str, str]:
    """``("tensor_parallel" | "fsdp2", why)`` for a model of ``model_config`` sharded over ``world_size`` ranks."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    plan = getattr(text, "base_model_tp_plan", None) or getattr(model_config, "base_model_tp_plan", None)
    if not plan:
        return "fsdp2", f"{type(model_config).__name__} has no tensor-parallel plan"
    sizes = {name: getattr(text, name, None) for name in ("num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size")}
    uneven = {name: size for name, size in sizes.items() if isinstance(size, int) and size % world_size}
    if uneven:
        return "fsdp2", f"{uneven} do not divide by gpus_per_replica={world_size}"
    return "tensor_parallel", f"transformers' tensor-parallel plan of {type(model_config).__name__}"


def load_sharded(load: Any, path: str, trust_remote_code: bool, device: torch.device, world_size: int,
                 method: str | None = None) -> tuple[Any, dict[str, str]]:
    """Load the RM sharded over the (initialised) group with ``load(**from_pretrained_kwargs)``: ``(model,
    {"sharding", "sharding_reason"})``. ``method`` forces ``tensor_parallel`` or ``fsdp2`` (benchmarks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    if method is None:
        model_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        method, why = sharding_method(model_config, world_size)
    else:
        why = "asked for"
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    if method == "tensor_parallel":
        model = load(tp_plan="auto", device_mesh=mesh)
        if next(model.parameters()).device.type != device.type:
            # transformers (5.17, seen on an H200) leaves a tensor-parallel load over a group of one on the host
            model = model.to(device)
    else:
        from torch.distributed.fsdp import fully_shard

        model = load()
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
        for layer in max(lists, key=len) if lists else []:  # the repeated blocks (largest ModuleList): FSDP2's units
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        model = model.to(device)
    logger.info("RM sharded over %d ranks by %s (%s)", world_size, method, why)
    return model, {"sharding": method, "sharding_reason": why}


def weights_bytes(path: str) -> tuple[int, str | None] | None:
    """The checkpoint's weights as stored: ``(bytes, dtype)`` from its safetensors index (``metadata.total_size``),
    else the sizes of its weight files; the dtype from ``config.json``. None when there are no weight files."""
    root = Path(path)
    config = config_json(path)
    dtype = config.get("torch_dtype") or config.get("dtype")
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        try:
            total = json.loads((root / index).read_text())["metadata"]["total_size"]
            return int(total), dtype
        except (OSError, ValueError, KeyError, TypeError):
            continue
    files = list(root.glob("*.safetensors")) or list(root.glob("*.bin"))
    total = sum(f.stat().st_size for f in files if not f.name.startswith("training_args"))
    return (total, dtype) if total else None


def config_json(path: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` for sizing it: empty when it cannot be read."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def rm_weights_bytes(config: Any) -> tuple[int, str] | None:
    """The RM's weights in its dtype on the GPU, and that dtype (``'auto'``: bfloat16); None without weight files."""
    stored = weights_bytes(config.model_path)
    if stored is None:
        return None
    dtype = "bfloat16" if config.dtype == "auto" else config.dtype
    return stored[0] * ELEMENT_BYTES[dtype] // ELEMENT_BYTES.get(str(stored[1]), ELEMENT_BYTES[dtype]), dtype


def check_replica_memory(config: Any, device_bytes: int) -> None:
    """Refuse, before loading, an RM whose weights cannot fit its replica's ``gpus_per_replica`` GPUs of
    ``device_bytes`` each: a ``ConfigValueError`` on ``gpus_per_replica`` naming the value that fits."""
    sized = rm_weights_bytes(config)
    if sized is None:
        return
    weights, dtype = sized
    k, per_node = config.gpus_per_replica, config.n_gpus_per_node
    need = -(-weights // int(WEIGHTS_SHARE * device_bytes))
    if need <= k:
        return
    fits = [d for d in range(need, per_node + 1) if per_node % d == 0]
    fix = (f"set {{key}}={fits[0]}" if fits else
           f"the RM needs {need} GPUs of this type per replica, all on one node, and the pool's nodes have "
           f"n_gpus_per_node={per_node}: give the pool nodes of at least {need} GPUs (n_gpus_per_node a multiple of "
           f"{need}), or GPUs with more memory")
    raise ConfigValueError(
        "gpus_per_replica", k,
        f"the RM's weights take {weights / _GIB:.1f} GiB in {dtype}, {weights / k / _GIB:.1f} GiB on each of the "
        f"replica's {k} GPU(s): more than {WEIGHTS_SHARE:.0%} of a {device_bytes / _GIB:.1f} GiB GPU of this pool", fix)

