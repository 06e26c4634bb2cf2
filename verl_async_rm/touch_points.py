"""Everything the plugin uses of verl (its touch points), each with a cheap check against the installed verl: the one
list behind ``verl-async-rm doctor``, ``tests/unit/test_verl_touch_points.py`` and the table in ``docs/versions.md``.

A check binds, with ``inspect.signature``, exactly what the plugin passes (or the parameter names it overrides), reads
a class attribute or a registry, reads verl's installed source (AST: call-site shapes, and modules too costly to
import) or verl's flattened reference config (``trainer/config/_generated_ppo_trainer.yaml``, with OmegaConf). No check
starts Ray, needs a GPU or changes verl. A group behind a gate (``v1``: ``verl.trainer.ppo.v1`` importable, which it
is not on verl's ``neo`` branch; ``vllm``: vLLM installed) reports its points ``unavailable``, with the reason.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TouchPoint", "Result", "TOUCH_POINTS", "check", "run_checks", "gate"]

Check = Callable[[], None]


class _Changed(Exception):
    """Raised by a check when verl no longer has what the plugin relies on; the message says what verl has now."""


@dataclasses.dataclass(frozen=True)
class TouchPoint:
    """One thing the plugin uses of verl; ``check()`` returns when the installed verl still has it."""

    id: str
    symbol: str  # verl's ``module:qualname``, or config keys
    relies_on: str  # what the plugin relies on, one line
    files: tuple[str, ...]  # the plugin's files that rely on it (under verl_async_rm/, but pyproject.toml)
    check: Check = dataclasses.field(repr=False, compare=False)
    group: str = "core"  # "core", "v1" (needs verl.trainer.ppo.v1) or "vllm" (needs vLLM)


@dataclasses.dataclass(frozen=True)
class Result:
    """A touch point's check: ``status`` is ``ok``, ``changed`` or ``unavailable`` (its group's gate is closed);
    ``detail`` says what verl has now (``changed``) or why the point was not checked (``unavailable``)."""

    point: TouchPoint
    status: str
    detail: str = ""

    @property
    def message(self) -> str:
        p = self.point
        if self.status == "changed":
            return f"{p.id} [{p.symbol}]: verl now has {self.detail}; relied on by {', '.join(p.files)}: {p.relies_on}"
        return f"{p.id}: {'not checked, ' + self.detail if self.status == 'unavailable' else 'OK'}"


# --- check builders: each returns a check (no arguments; raises _Changed) --------------------------------------------

_ANY, _ABSENT = type("AnyValue", (), {})(), type("Absent", (), {})()  # expected config values: present, absent


def _get(path: str) -> Any:
    """``"module:Qual.name"`` -> the object (imports the module)."""
    module, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in filter(None, qualname.split(".")):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise _Changed(f"no {path.rstrip(':')} ({type(exc).__name__}: {exc})") from None
    return obj


def _plain(sig: inspect.Signature) -> str:
    return str(sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty))


def _sig(path: str, *args: Any, **kwargs: Any) -> Check:
    """``path``'s signature binds ``args``/``kwargs``: what the plugin passes (``"self"`` stands for the instance)."""
    def run() -> None:
        sig = inspect.signature(_get(path))
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            passed = ", ".join([*map(repr, args), *(f"{k}=" for k in kwargs)])
            raise _Changed(f"{path.split(':')[1]}{_plain(sig)}, which does not take ({passed}): {exc}") from None
    return run


def _named(path: str, *names: str, var_keyword: bool = False) -> Check:
    """``path``'s parameters start with ``names`` (and it takes ``**kwargs``): the plugin overrides it so."""
    def run() -> None:
        sig = inspect.signature(_get(path))
        params = list(sig.parameters.values())
        if [p.name for p in params[:len(names)]] != list(names) or (
                var_keyword and not any(p.kind is p.VAR_KEYWORD for p in params)):
            wanted = ", ".join([*names, *(["**kwargs"] if var_keyword else [])])
            raise _Changed(f"{path.split(':')[1]}{_plain(sig)}, overridden as ({wanted})")
    return run


def _attrs(path: str, *names: str, own: bool = False) -> Check:
    """``path`` has these attributes (``own``: the class defines them itself, so a class-level wrap reaches them)."""
    def run() -> None:
        obj = _get(path)
        if missing := [n for n in names if (n not in vars(obj) if own else not hasattr(obj, n))]:
            raise _Changed(f"{path.split(':')[1] or path.rstrip(':')} without {', '.join(missing)}")
    return run


def _check(condition: Callable[[], bool], says: Callable[[], str]) -> Check:
    """``condition()`` holds, else verl has what ``says()`` tells."""
    def run() -> None:
        if not condition():
            raise _Changed(says())
    return run


def _all(*checks: Check) -> Check:
    def run() -> None:
        for one in checks:
            one()
    return run


@functools.cache
def _source(module: str) -> tuple[Path, ast.Module]:
    """The installed file of ``module`` and its AST, found without importing anything."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise _Changed(f"no package {top} installed")
    base = Path(list(spec.submodule_search_locations)[0], *rest.split(".") if rest else ())
    path = base.with_suffix(".py") if rest and base.with_suffix(".py").is_file() else base / "__init__.py"
    if not path.is_file():
        raise _Changed(f"no module {module}")
    return path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def _node(module: str, qualname: str = "") -> Any:
    """The class or function ``qualname`` in ``module``'s source (the module's AST for ``""``)."""
    node: Any = _source(module)[1]
    for part in qualname.split(".") if qualname else ():
        node = next((n for n in getattr(node, "body", []) if getattr(n, "name", None) == part
                     and isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))), None)
        if node is None:
            raise _Changed(f"no {qualname} in {module}")
    return node


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of ``name(...)`` or ``<x>.name(...)`` in ``node`` (a dotted ``name``: exactly it), in source order."""
    return sorted((n for n in ast.walk(node) if isinstance(n, ast.Call) and (
        ast.unparse(n.func) == name if "." in name else name in (getattr(n.func, "id", None),
                                                                 getattr(n.func, "attr", None)))),
        key=lambda c: c.lineno)


def _call_sites(module: str, qualname: str, name: str, plugin: inspect.Signature, *first: Any,
                then: Callable[[inspect.BoundArguments], None] | None = None, keyword: str | None = None) -> Check:
    """Every call of ``name`` in ``module``'s ``qualname`` (at least one; with ``keyword``: those passing it) binds
    ``plugin``, the plugin's signature, by its shape (positional count, keyword names; ``*x``/``**x`` left out);
    ``then(bound)`` checks what the plugin passes on."""
    def run() -> None:
        calls = [c for c in _calls(_node(module, qualname), name)
                 if keyword is None or any(k.arg == keyword for k in c.keywords)]
        if not calls:
            raise _Changed(f"no call of {name}(...) in {module}:{qualname}")
        for call in calls:
            try:
                bound = plugin.bind(*first, *(ast.unparse(a) for a in call.args if not isinstance(a, ast.Starred)),
                                    **{k.arg: ast.unparse(k.value) for k in call.keywords if k.arg})
            except TypeError as exc:
                raise _Changed(f"the call {ast.unparse(call)} (line {call.lineno} of {module}), which the plugin's "
                               f"{name.split('.')[-1]}{plugin} does not take: {exc}") from None
            if then is not None:
                then(bound)
    return run


def _mentions(module: str, qualname: str, *names: str, stored: bool = False) -> Check:
    """``module``'s ``qualname`` (``""``: the module) defines, imports, reads or holds as a string each of ``names``
    (``stored``: assigns ``self.<name>``)."""
    def run() -> None:
        found = set()
        for n in ast.walk(_node(module, qualname)):
            if stored:
                found.add(n.attr if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                          and getattr(n.value, "id", None) == "self" else None)
            else:
                found.update([getattr(n, "name", None), getattr(n, "asname", None), getattr(n, "id", None),
                              getattr(n, "attr", None), n.value if isinstance(n, ast.Constant) else None])
        if missing := [n for n in names if n not in found]:
            raise _Changed(f"a {module}:{qualname} that no longer {'sets self.' if stored else 'has '}"
                           f"{', '.join(missing)}")
    return run


@functools.cache
def _reference_config() -> Any:
    from omegaconf import OmegaConf

    path = _source("verl")[0].parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    if not path.is_file():
        raise _Changed("no trainer/config/_generated_ppo_trainer.yaml")
    return OmegaConf.load(path)


def _config(expected: dict[str, Any]) -> Check:
    """verl's reference config has each key with the value the plugin relies on (``_ANY``: present; ``_ABSENT``)."""
    def run() -> None:
        from omegaconf import OmegaConf

        def shown(value: Any) -> str:
            return {id(_ANY): "any value", id(_ABSENT): "absent"}.get(id(value), repr(value))

        wrong = []
        for key, want in expected.items():
            got = OmegaConf.select(_reference_config(), key, default=_ABSENT, throw_on_resolution_failure=False)
            if not (got is want or (want is _ANY and got is not _ABSENT) or (got is not _ABSENT and got == want)):
                wrong.append(f"{key}: {shown(got)} (relied on: {shown(want)})")
        if wrong:
            raise _Changed("in its reference config " + "; ".join(wrong))
    return run


# --- checks of more than one line -------------------------------------------------------------------------------------

_AL, _TQ, _V1T = ("verl.experimental.agent_loop.agent_loop", "verl.trainer.ppo.v1.agent_loop_tq",
                  "verl.trainer.ppo.v1.trainer_base")
_RT, _BASE, _MAIN = "verl.trainer.ppo.ray_trainer", "verl.single_controller.ray.base", "verl.trainer.main_ppo"
#: The plugin's signatures that verl's call sites must bind: the worker's overrides and the manager's ``create``.
_SCORE = inspect.signature(lambda self, outputs, kwargs, *args, **options: None)
_POSTPROCESS = inspect.signature(lambda self, output, validate, **kwargs: None)
_RUN = inspect.signature(lambda self, sampling_params, trajectory, *args, **kwargs: None)
_CREATE = inspect.signature(lambda config, llm_client, teacher_client=None, reward_loop_worker_handles=None: None)


def _forwards_score(bound: inspect.BoundArguments) -> None:
    """verl's ``_compute_score`` takes what the override passes on: ``(outputs, kwargs, *args, **options)``."""
    a = bound.arguments
    sig = inspect.signature(_get(f"{_AL}:AgentLoopWorker._compute_score"))
    try:
        sig.bind("self", a["outputs"], a["kwargs"], *a.get("args", ()), **a.get("options", {}))
    except TypeError as exc:
        raise _Changed(f"AgentLoopWorker._compute_score{_plain(sig)}, which does not take what its callers pass: "
                       f"{exc}") from None


def _preset_kept() -> None:
    init = _node(_AL, "AgentLoopManager.__init__")
    stores = {n for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and n.attr == "agent_loop_workers_class"}
    guarded = {n for g in ast.walk(init) if isinstance(g, ast.If) and "hasattr" in ast.unparse(g.test)
               and "agent_loop_workers_class" in ast.unparse(g.test) for s in g.body for n in ast.walk(s)}
    if stores - guarded:
        raise _Changed(f"an AgentLoopManager.__init__ that sets agent_loop_workers_class unconditionally (line "
                       f"{min(n.lineno for n in stores - guarded)})")


def _v0_fit_order() -> None:
    fit = _node(_RT, "RayPPOTrainer.fit")
    gen, sleep, wake = (_calls(fit, name) for name in ("generate_sequences", "sleep_replicas", "update_weights"))
    after = [s.lineno for s in sleep if gen and s.lineno > gen[0].lineno]
    if not (after and any(w.lineno > after[0] for w in wake)) or not any(
            isinstance(n, ast.Subscript) and ast.unparse(n).endswith("meta_info['timing']") for n in ast.walk(fit)):
        raise _Changed(f"a RayPPOTrainer.fit with generate_sequences / sleep_replicas / update_weights at lines "
                       f"{[c.lineno for c in gen]} / {[c.lineno for c in sleep]} / {[c.lineno for c in wake]}, "
                       "or not reading meta_info['timing']")


def _v0_validate_flag() -> bool:
    return any(isinstance(n, ast.Dict) and any(getattr(k, "value", None) == "validate" and getattr(v, "value", 0)
                                               is True for k, v in zip(n.keys, n.values))
               for n in ast.walk(_node(_RT, "RayPPOTrainer._validate")))


def _colocate_count() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(_get(f"{_BASE}:ResourcePoolManager"))}
    if fields.get("max_colocate_count") != 3:
        raise _Changed(f"ResourcePoolManager.max_colocate_count default {fields.get('max_colocate_count')!r}")
    for module in ("verl.trainer.main_ppo_v0", _V1T):
        try:
            calls = _calls(_node(module), "ResourcePoolManager")
        except _Changed:
            continue  # no v1 trainer: nothing there passes it
        if passing := [c.lineno for c in calls if any(k.arg == "max_colocate_count" for k in c.keywords)]:
            raise _Changed(f"{module} passing max_colocate_count to ResourcePoolManager (line {passing[0]})")


#: ``trainer.data_plane`` values under which the plugin's edits of a v0 batch land as it writes them.
DATA_PLANES = ("classic", "neoproto")


def _data_plane() -> None:
    """verl 0.9.1 has no ``trainer.data_plane`` (its ``DataProto`` is the classic one); verl's ``neo`` branch adds it
    (``classic`` or ``neoproto``). A default other than those, or a key that is not a plain name, is named."""
    from omegaconf import OmegaConf

    got = OmegaConf.select(_reference_config(), "trainer.data_plane", default=_ABSENT,
                           throw_on_resolution_failure=False)
    if got is not _ABSENT and got not in DATA_PLANES:
        raise _Changed(f"in its reference config trainer.data_plane: {got!r} (relied on: absent, or one of "
                       f"{', '.join(DATA_PLANES)})")


def _auto_await_runs() -> bool:
    auto_await = _get("verl.utils.ray_utils:auto_await")

    @auto_await
    async def one() -> int:
        return 1

    async def caller() -> int:
        return await one()

    return one() == 1 and asyncio.run(caller()) == 1


def _registered() -> bool:
    from verl_async_rm.integration.reward_manager import AsyncRMRewardManager

    registry = _get("verl.experimental.reward_loop.reward_manager.registry:")
    return registry.get_reward_manager_cls("async_rm") is AsyncRMRewardManager and "async_rm" in registry.REWARD_MANAGER


def _abstract_left() -> list[str]:
    from verl_async_rm import cpu_platform

    return sorted(getattr(cpu_platform.platform_class(), "__abstractmethods__", ()))


def _loads_plugins() -> bool:
    from importlib.metadata import entry_points

    return any(ast.unparse(k.value) == "'verl.plugins'" and "entry_points" in ast.unparse(c.func)
               for c in ast.walk(_node("verl")) if isinstance(c, ast.Call) for k in c.keywords if k.arg == "group") \
        and any(ep.value == "verl_async_rm.plugin" for ep in entry_points(group="verl.plugins", name="async_rm"))


def _v1_modes() -> bool:
    from verl_async_rm.integration.checks import V1_TRAINER_MODES

    registry = _get(f"{_V1T}:TRAINER_REGISTRY")
    return set(registry) == set(V1_TRAINER_MODES) and not [c for c in registry.values()
                                                           if {"step", "_validate"} & set(vars(c))]


def _legacy_null() -> None:
    from verl_async_rm.integration.checks import LEGACY_KEYS

    _config({**dict.fromkeys(LEGACY_KEYS), "reward_model.model.trust_remote_code": None})()


# --- the list ---------------------------------------------------------------------------------------------------------

_P = TouchPoint
_WORKER, _MANAGER, _V1, _HOOKS = ("integration/agent_loop_worker.py", "integration/agent_loop_manager.py",
                                  "integration/v1.py", "integration/trainer_hooks.py")
_PLACE, _CHECKS, _RM = "service/placement.py", "integration/checks.py", "verl.experimental.reward_loop.reward_manager"
_RLOOP, _PLAT, _TURN = ("verl.experimental.reward_loop.reward_loop", "verl.plugin.platform",
                        "verl.experimental.agent_loop.single_turn_agent_loop")
_NONE = inspect.signature(lambda: None)

TOUCH_POINTS: tuple[TouchPoint, ...] = (
    _P("entry-point", "verl/__init__.py: entry_points(group='verl.plugins')",
       "`import verl` loads our `async_rm = verl_async_rm.plugin` unless `VERL_USE_EXTERNAL_PLUGINS=none`",
       ("pyproject.toml", "plugin.py"),
       _all(_check(_loads_plugins, lambda: "no verl.plugins loop, or no async_rm entry point (pip install it)"),
            _mentions("verl", "", "VERL_USE_EXTERNAL_PLUGINS"))),
    _P("reward-registry", f"{_RM}:register, registry.REWARD_MANAGER, get_reward_manager_cls",
       "`@register(\"async_rm\")` adds the plugin's manager when verl's registry is imported; verl finds it by name",
       ("plugin.py", "integration/reward_manager.py", _CHECKS),
       _all(_sig(f"{_RM}:register", "async_rm"),
            _check(_registered, lambda: "a registry where async_rm is not the plugin's AsyncRMRewardManager"))),
    _P("naive-reward-manager", f"{_RM}.naive:NaiveRewardManager.run_single",
       "subclassed with verl's `__init__`; `async run_single(self, data)` overridden, verl's called through super()",
       ("integration/reward_manager.py",),
       _all(_named(f"{_RM}.naive:NaiveRewardManager.run_single", "self", "data"),
            _check(lambda: inspect.iscoroutinefunction(_get(f"{_RM}.naive:NaiveRewardManager.run_single")),
                   lambda: "a NaiveRewardManager.run_single that is not a coroutine function"))),
    _P("platform", f"{_PLAT}: PlatformRegistry, PlatformBase, platform_manager._current_platform",
       "`PlatformRegistry.register(platform=\"cpu\")` of a complete `PlatformBase`; the private `_current_platform`, "
       "`set_platform(p)`; `ray_resource_name()`, `ray_resource_options(n)`",
       ("plugin.py", "cpu_platform.py", _PLACE, "service/ranks.py"),
       _all(_sig(f"{_PLAT}:PlatformRegistry.register", platform="cpu"), _sig(f"{_PLAT}:set_platform", None),
            _sig(f"{_PLAT}:get_platform"), _attrs(f"{_PLAT}.platform_manager:", "_current_platform"),
            _check(lambda: not _abstract_left(), lambda: f"abstract methods PlatformCPU lacks: {_abstract_left()}"),
            _sig(f"{_PLAT}:PlatformBase.ray_resource_name", "self"),
            _sig(f"{_PLAT}:PlatformBase.ray_resource_options", "self", 1))),
    _P("validate-config", "verl.utils.config:validate_config",
       "replaced by a wrapper `(config, *args, **kwargs)` before `main_ppo` imports it; `main` calls it before "
       "`run_ppo`, so the plugin's config checks run before Ray starts", ("plugin.py",),
       _all(_sig("verl.utils.config:validate_config", config=None, use_reference_policy=True, use_critic=False),
            _mentions(_MAIN, "", "validate_config"),
            _call_sites(_MAIN, "main", "validate_config", inspect.signature(lambda config, *a, **k: None)),
            _check(lambda: _calls(_node(_MAIN, "main"), "validate_config")[0].lineno
                   < min([c.lineno for c in _calls(_node(_MAIN, "main"), "run_ppo")], default=0),
                   lambda: "a main that does not call validate_config before run_ppo"))),
    _P("main-ppo", f"{_MAIN}:main, verl.experimental.reward_loop:migrate_legacy_reward_impl",
       "`@hydra.main(config_path=\"config\", config_name=\"ppo_trainer\")`, run undecorated (`__wrapped__`) after "
       "`migrate_legacy_reward_impl(config)`", ("main_ppo.py",),
       _all(_check(lambda: any("config_name='ppo_trainer'" in ast.unparse(d) and "config_path='config'"
                               in ast.unparse(d) for d in _node(_MAIN, "main").decorator_list),
                   lambda: "a main not decorated with hydra.main(config_path='config', config_name='ppo_trainer')"),
            _sig("verl.experimental.reward_loop:migrate_legacy_reward_impl", None))),
    _P("resolve-reward-manager", "verl.trainer.ppo.reward:resolve_reward_manager_cls",
       "`resolve_reward_manager_cls(config)` resolves the reward manager up front, as verl's reward loop will",
       (_CHECKS,), _sig("verl.trainer.ppo.reward:resolve_reward_manager_cls", None)),
    _P("manager-class-key", f"{_RT}:RayPPOTrainer.init_workers",
       "loads `actor_rollout_ref.rollout.agent.agent_loop_manager_class` with `load_class_from_fqn`, calls its "
       "`create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)`", ("__init__.py", _MANAGER),
       _all(_sig("verl.utils.import_utils:load_class_from_fqn", "verl_async_rm.AsyncRMAgentLoopManager", "x"),
            _mentions(_RT, "RayPPOTrainer.init_workers", "agent_loop_manager_class", "load_class_from_fqn"),
            _call_sites(_RT, "RayPPOTrainer.init_workers", "create", _CREATE, keyword="llm_client"))),
    # the agent loop
    _P("worker-init", f"{_AL}:AgentLoopWorker.__init__", "subclassed; built by verl's manager with "
       "`.remote(config, llm_client, teacher_client, reward_loop_worker_handles)`", (_WORKER, _V1),
       _sig(f"{_AL}:AgentLoopWorker.__init__", "self", "config", "llm_client", "teacher", "handles")),
    _P("worker-compute-score", f"{_AL}:AgentLoopWorker._compute_score",
       "overridden as `(self, outputs, kwargs, *args, **options)`: verl's calls bind it (`validate=`, verl PR #7217, "
       "read when passed), verl's method takes what it passes on", (_WORKER,),
       _call_sites(_AL, "AgentLoopWorker", "_compute_score", _SCORE, "self", then=_forwards_score)),
    _P("worker-postprocess", f"{_AL}:AgentLoopWorker._agent_loop_postprocess",
       "overridden as `(self, output, validate, **kwargs)` for the phase (train, val); verl calls it so, it calls "
       "`_compute_score`", (_WORKER,),
       _all(_named(f"{_AL}:AgentLoopWorker._agent_loop_postprocess", "self", "output", "validate", var_keyword=True),
            _call_sites(_AL, "AgentLoopWorker", "_agent_loop_postprocess", _POSTPROCESS, "self"),
            _call_sites(_AL, "AgentLoopWorker._agent_loop_postprocess", "_compute_score", _SCORE, "self"))),
    _P("worker-run-agent-loop", f"{_AL}:AgentLoopWorker._run_agent_loop",
       "overridden as `(self, sampling_params, trajectory, *args, **kwargs)` to withdraw a trajectory whose agent loop "
       "failed from the group judges; verl's calls bind it, `trajectory['validate']` and the prompt's `uid` in "
       "`kwargs`", (_WORKER,),
       _all(_named(f"{_AL}:AgentLoopWorker._run_agent_loop", "self", "sampling_params", "trajectory",
                   var_keyword=True),
            _call_sites(_AL, "AgentLoopWorker", "_run_agent_loop", _RUN, "self"),
            _mentions(_AL, "AgentLoopWorker._run_agent_loop", "validate"))),
    _P("worker-outputs", f"{_AL}:AgentLoopWorker._postprocess, AgentLoopOutput, AgentLoopMetrics",
       "(v0) `reward_score` -> `rm_scores`, `reward_extra_info`/`extra_fields` keys -> columns; output fields "
       "`prompt_ids`... `metrics.compute_score`; `as_dict(self)` overridden",
       ("integration/drops.py", "integration/token_rewards.py", "request.py", _WORKER),
       _all(_mentions(_AL, "AgentLoopWorker._postprocess", "rm_scores", "reward_extra_info", "extra_fields"),
            _check(lambda: {"prompt_ids", "response_ids", "response_mask", "num_turns", "reward_score", "extra_fields",
                            "metrics"} <= set(_get(f"{_AL}:AgentLoopOutput").model_fields)
                   and "compute_score" in _get(f"{_AL}:AgentLoopMetrics").model_fields,
                   lambda: f"AgentLoopOutput fields {sorted(_get(f'{_AL}:AgentLoopOutput').model_fields)}"),
            _sig(f"{_AL}:AgentLoopOutput.as_dict", "self"))),
    _P("manager-init", f"{_AL}:AgentLoopManager.__init__", "takes `(config, llm_client, teacher_client, "
       "reward_loop_worker_handles)`, keeps an `agent_loop_workers_class` set before it (the v0 manager's)",
       (_MANAGER,), _all(_sig(f"{_AL}:AgentLoopManager.__init__", "self", "config", "llm", "teacher", "handles"),
                         _preset_kept)),
    _P("manager-create", f"{_AL}:AgentLoopManager.create, _init_agent_loop_workers",
       "`create` awaits `_init_agent_loop_workers()` (overridden), which builds `self.agent_loop_workers` from "
       "`self.agent_loop_workers_class`", (_MANAGER, _V1),
       _all(_call_sites(_AL, "AgentLoopManager.create", "_init_agent_loop_workers", _NONE),
            _sig(f"{_AL}:AgentLoopManager._init_agent_loop_workers", "self"),
            _mentions(_AL, "AgentLoopManager._init_agent_loop_workers", "agent_loop_workers", stored=True),
            _mentions(_AL, "AgentLoopManager._init_agent_loop_workers", "agent_loop_workers_class"))),
    _P("manager-generate", f"{_AL}:AgentLoopManager.generate_sequences, verl.utils.ray_utils:auto_await",
       "(v0) overridden with `@auto_await`, awaiting verl's coroutine; the plugin's metrics go into its "
       "`meta_info[\"timing\"]`", (_MANAGER, _V1),
       _all(_sig(f"{_AL}:AgentLoopManager.generate_sequences", "self", "prompts"),
            _check(lambda: inspect.iscoroutinefunction(inspect.unwrap(
                _get(f"{_AL}:AgentLoopManager.generate_sequences"))), lambda: "a generate_sequences not async"),
            _mentions(_AL, "AgentLoopManager.generate_sequences", "timing"),
            _check(_auto_await_runs, lambda: "an auto_await that does not both run and hand over a coroutine"))),
    _P("data-proto", "verl:DataProto", "(v0) the manager edits the returned batch: `batch` (`rm_scores`, "
       "`response_mask`), `non_tensor_batch`, `meta_info`", (_MANAGER, "integration/drops.py",
                                                             "integration/token_rewards.py"),
       _check(lambda: {"batch", "non_tensor_batch", "meta_info"} <= {
           f.name for f in dataclasses.fields(_get("verl:DataProto"))},
           lambda: "a verl.DataProto without the dataclass fields batch, non_tensor_batch, meta_info")),
    # the v0 trainer
    _P("v0-validate", f"{_RT}:RayPPOTrainer._validate",
       "wrapped at class level as `_validate(self, merged=False)` (`fit` logs its dict); reads "
       "`self.async_rollout_manager`; its batches carry `meta_info[\"validate\"] = True`", (_MANAGER,),
       _all(_attrs(f"{_RT}:RayPPOTrainer", "_validate", own=True),
            _sig(f"{_RT}:RayPPOTrainer._validate", "self", merged=False),
            _call_sites(_RT, "RayPPOTrainer.fit", "self._validate", inspect.signature(lambda merged=False: None)),
            _mentions(_RT, "RayPPOTrainer.init_workers", "async_rollout_manager", stored=True),
            _check(_v0_validate_flag, lambda: "a _validate whose batches lack meta_info {'validate': True}"))),
    _P("v0-fit-order", f"{_RT}:RayPPOTrainer.fit",
       "`generate_sequences`, then `sleep_replicas()`, then `update_weights(...)` before the next rollout (the RMs on "
       "the policy's GPUs sleep and wake around it); `meta_info[\"timing\"]` logged", (_MANAGER,), _v0_fit_order),
    # the single controller
    _P("resource-pool", f"{_BASE}:RayResourcePool, SubRayResourcePool, sort_placement_group_by_node_ip",
       "subclassed: `__init__(process_on_nodes=, use_gpu=, name_prefix=, max_colocate_count=)`, "
       "`get_placement_groups(self, strategy, name, device_name)`; `pgs`, `store`; groups `...verl_group_...`",
       (_PLACE, "service/policy_pool.py"),
       _all(_sig(f"{_BASE}:RayResourcePool", process_on_nodes=[1], use_gpu=False, name_prefix="x",
                 max_colocate_count=1), _attrs(f"{_BASE}:RayResourcePool", "store"),
            _named(f"{_BASE}:RayResourcePool.get_placement_groups", "self", "strategy", "name", "device_name"),
            _mentions(_BASE, "RayResourcePool.__init__", "pgs", "use_gpu", stored=True),
            _mentions(_BASE, "RayResourcePool.get_placement_groups", "verl_group_"),
            _sig(f"{_BASE}:SubRayResourcePool", placement_groups=[], start_bundle_index=0, subgroup_world_size=1,
                 process_on_nodes=[1], use_gpu=False, max_colocate_count=1, name_prefix="x"),
            _sig(f"{_BASE}:sort_placement_group_by_node_ip", []))),
    _P("colocate-count", f"{_BASE}:ResourcePoolManager.max_colocate_count",
       "the class default 3 is `global_pool`'s (no verl caller passes another; PR #7307 would): an RM on the policy's "
       "GPUs takes 1/3 of a bundle", (_CHECKS, "service/policy_pool.py"), _colocate_count),
    _P("worker-group", f"{_BASE}:RayWorkerGroup, RayClassWithInitArgs",
       "`RayWorkerGroup(resource_pool=, name_prefix=, ray_cls_with_init=, device_name=)`, `workers`, `name_prefix`; "
       "`RayClassWithInitArgs(cls=, config=)`", (_PLACE,),
       _all(_sig(f"{_BASE}:RayWorkerGroup", resource_pool=None, name_prefix="x", ray_cls_with_init=None,
                 device_name="cpu"), _attrs(f"{_BASE}:RayWorkerGroup", "workers"),
            _mentions(_BASE, "RayWorkerGroup.__init__", "name_prefix", stored=True),
            _sig(f"{_BASE}:RayClassWithInitArgs", cls=object, config=None),
            _sig(f"{_BASE}:RayClassWithInitArgs.set_additional_resource", "self", {}),
            _sig(f"{_BASE}:RayClassWithInitArgs.update_options", "self", {}))),
    _P("rm-worker", "verl.single_controller.base:Worker, decorator.register; verl.utils.device",
       "`RMReplica(Worker)`: `super().__init__()`, `rank`, `world_size`, "
       "`@register(dispatch_mode=Dispatch.ONE_TO_ALL)`; `get_device_name()` & co.",
       ("service/replica.py", _PLACE, "service/ranks.py", "scoring/scorer.py"),
       _all(_sig("verl.single_controller.base:Worker.__init__", "self"),
            _attrs("verl.single_controller.base:Worker", "rank", "world_size"),
            _sig("verl.single_controller.base.decorator:register", dispatch_mode=None),
            _attrs("verl.single_controller.base.decorator:Dispatch", "ONE_TO_ALL"),
            *(_sig(f"verl.utils.device:{name}") for name in ("get_device_name", "get_resource_name",
                                                               "get_torch_device", "get_device_id")),
            _sig("verl.utils.ray_utils:ray_noset_visible_devices"))),
    # the CPU platform's workarounds
    _P("process-group", "verl.utils.distributed:initialize_global_process_group_ray",
       "its two parameters `(timeout_second, backend)`: the CPU platform sets `__defaults__` to `(None, \"gloo\")`",
       ("cpu_platform.py",),
       _named("verl.utils.distributed:initialize_global_process_group_ray", "timeout_second", "backend")),
    _P("engine-registry", "verl.workers.engine.base:EngineRegistry, verl.workers.engine.fsdp.transformer_impl",
       "the private `EngineRegistry._engines`, `register(model_type=, backend=, device=\"cpu\")`; "
       "`transformer_impl.CPUOffloadPolicy` replaced (source read: the import costs seconds)", ("cpu_platform.py",),
       _all(_check(lambda: isinstance(getattr(_get("verl.workers.engine.base:EngineRegistry"), "_engines", 0), dict),
                   lambda: "an EngineRegistry without a _engines dict"),
            _sig("verl.workers.engine.base:EngineRegistry.register", model_type="m", backend=["fsdp"], device="cpu"),
            _mentions("verl.workers.engine.fsdp.transformer_impl", "", "FSDPEngineWithLMHead",
                      "FSDPEngineWithValueHead", "CPUOffloadPolicy"))),
    _P("vllm-cpu-gemm", "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
       "vLLM's, not verl's: `dispatch_cpu_unquantized_gemm(layer, remove_weight)` replaced on CPU (source read)",
       ("cpu_platform.py",),
       _check(lambda: [a.arg for a in _node("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm")
                       .args.args] == ["layer", "remove_weight"],
              lambda: "a dispatch_cpu_unquantized_gemm without the parameters (layer, remove_weight)"), "vllm"),
    # the demo's and the test utilities'
    _P("demo", "verl.experimental.reward_loop: RewardLoopWorker, RewardLoopManager; SingleTurnAgentLoop",
       "(demo) subclassed: `RewardLoopWorker(config, address)`, `compute_score_disrm(self, data)`, "
       "`RewardLoopManager(config, rm_resource_pool=)`, `_init_reward_loop_workers`; `SingleTurnAgentLoop.run`",
       ("demo/served_rm.py", "demo/agent_loop.py"),
       _all(_sig(f"{_RLOOP}:RewardLoopWorker", None, None),
            _named(f"{_RLOOP}:RewardLoopWorker.compute_score_disrm", "self", "data"),
            _sig("verl.experimental.reward_loop:RewardLoopManager", None, rm_resource_pool=None),
            _mentions(_RLOOP, "RewardLoopManager._init_reward_loop_workers", "reward_loop_workers", stored=True),
            _named(f"{_TURN}:SingleTurnAgentLoop.run", "self", "sampling_params", var_keyword=True),
            _mentions(_TURN, "SingleTurnAgentLoop", "response_length", stored=True),
            _mentions(_AL, "AgentLoopBase.__init__", "tokenizer", stored=True))),
    _P("rollout-testing", "verl.workers.rollout: router.get_router_handle, llm_server.LLMServerClient, replica",
       "(testing) `get_router_handle(servers, full_determinism=)`, `LLMServerClient(config=, load_balancer_handle=)`, "
       "`TokenOutput`, `get_rollout_replica_class`, `get_ppo_ray_runtime_env(config)`",
       ("testing/generation.py", "testing/vllm_rollout.py", "testing/trainer_run.py"),
       _all(_sig("verl.workers.rollout.router:get_router_handle", {}, full_determinism=False),
            _sig("verl.workers.rollout.llm_server:LLMServerClient", config=None, load_balancer_handle=None),
            _attrs("verl.workers.rollout.replica:", "TokenOutput", "get_rollout_replica_class"),
            _sig("verl.trainer.constants_ppo:get_ppo_ray_runtime_env", None))),
    # verl's config (its reference config)
    _P("config-manager-key", "actor_rollout_ref.rollout.agent.agent_loop_manager_class",
       "absent from verl's config: recipes add it with `+` (Hydra refuses `+` for a key that exists)",
       ("plugin.py", "testing/trainer_config.py"),
       _config({"actor_rollout_ref.rollout.agent": _ANY,
                "actor_rollout_ref.rollout.agent.agent_loop_manager_class": _ABSENT})),
    _P("config-reward-model", "reward.reward_model.*",
       "`enable=False` (verl's own RM servers off), `enable_resource_pool=False`, `n_gpus_per_node=8`, `nnodes=0` "
       "(filled with the trainer's size when the RM has no pool of its own), `model_path`", ("config.py", _CHECKS),
       _config({"reward.reward_model.enable": False, "reward.reward_model.enable_resource_pool": False,
                "reward.reward_model.n_gpus_per_node": 8, "reward.reward_model.nnodes": 0,
                "reward.reward_model.model_path": None})),
    _P("config-reward-manager", "reward.reward_manager.*, reward.custom_reward_function.name, reward.num_workers",
       "`name=naive` (the rule weight's default depends on it), `source=register`, `module.path`, "
       "`custom_reward_function.name=compute_score`, `num_workers`", ("config.py", _CHECKS, "main_ppo.py"),
       _config({"reward.reward_manager.name": "naive", "reward.reward_manager.source": "register",
                "reward.reward_manager.module.path": None, "reward.custom_reward_function.name": "compute_score",
                "reward.num_workers": _ANY})),
    _P("config-legacy", "reward_model.*, custom_reward_function.*, sandbox_fusion.url (legacy keys)",
       "null unless a user sets them: a set one is refused, or migrated by the plugin's `main_ppo`",
       (_CHECKS, "main_ppo.py"), _legacy_null),
    _P("config-trainer", "trainer.use_v1, trainer.device, trainer.n_gpus_per_node, trainer.nnodes",
       "`use_v1=True` is verl's default (the manager picks v1 unless it is false); `device=cuda`",
       (_MANAGER, "config.py", _CHECKS),
       _config({"trainer.use_v1": True, "trainer.device": "cuda", "trainer.n_gpus_per_node": _ANY,
                "trainer.nnodes": _ANY})),
    _P("config-policy", "actor_rollout_ref.*, algorithm.*, data.*_files",
       "read: `rollout.n`, `val_kwargs.n`, `gpu_memory_utilization`, `model.path`, `tokenizer_path`, the offload and "
       "KL flags, `adv_estimator`, the data files", ("config.py", "scoring/colocation.py", _CHECKS),
       _config(dict.fromkeys([f"actor_rollout_ref.{k}" for k in (
           "rollout.n", "rollout.val_kwargs.n", "rollout.gpu_memory_utilization", "model.path", "model.tokenizer_path",
           "actor.fsdp_config.param_offload", "actor.fsdp_config.optimizer_offload", "ref.fsdp_config.param_offload",
           "actor.use_kl_loss")] + ["algorithm.use_kl_in_reward", "algorithm.adv_estimator", "data.train_files",
                                    "data.val_files"], _ANY))),
    _P("config-data-plane", "trainer.data_plane",
       "absent in 0.9.1 (the classic `DataProto`); `neo` adds `classic|neoproto` (NeoProto the v0 default from PR "
       "#7557): the v0 manager writes drops and token rewards as whole columns (`rm_scores`, `response_mask`, "
       "`meta_info[\"timing\"]`), which either data plane keeps; not run on `neoproto`",
       (_MANAGER, "integration/drops.py", "integration/token_rewards.py"), _data_plane),
    _P("config-transfer-queue", "transfer_queue.enable, transfer_queue.backend.SimpleStorage.num_data_storage_units",
       "(testing) the test configs and the CPU trainer set both, for v0 runs too",
       ("testing/trainer_config.py", "testing/cpu_trainer.py"),
       _config({"transfer_queue.enable": False, "transfer_queue.backend.SimpleStorage.num_data_storage_units": _ANY})),
    # the v1 trainer (TransferQueue)
    _P("v1-worker", f"{_TQ}:AgentLoopWorkerTQ",
       "a Ray actor class, subclassed through `__ray_actor_class__`; `_agent_loop_postprocess(self, output, validate, "
       "**kwargs)` overridden; its `_compute_score` calls bind the override", (_V1, _WORKER),
       _all(_sig(f"{_TQ}:AgentLoopWorkerTQ.__ray_actor_class__.__init__", "self", "c", "l", "t", "h"),
            _named(f"{_TQ}:AgentLoopWorkerTQ.__ray_actor_class__._agent_loop_postprocess", "self", "output",
                   "validate", var_keyword=True),
            _call_sites(_TQ, "AgentLoopWorkerTQ", "_compute_score", _SCORE, "self", then=_forwards_score),
            _call_sites(_TQ, "AgentLoopWorkerTQ", "_run_agent_loop", _RUN, "self")), "v1"),
    _P("v1-manager", f"{_TQ}:AgentLoopManagerTQ, {_MAIN}:TaskRunnerV1",
       "subclassed (worker class set after `__init__`); `create` awaits `_init_agent_loop_workers()`; "
       "`generate_sequences(self, prompts)`; `TaskRunnerV1` calls `create(config=, llm_client=, ...)`",
       (_V1, "testing/trainer_run.py"),
       _all(_sig(f"{_TQ}:AgentLoopManagerTQ", "config", "llm_client", "teacher", "handles"),
            _sig(f"{_TQ}:AgentLoopManagerTQ.generate_sequences", "self", "prompts"),
            _call_sites(_TQ, "AgentLoopManagerTQ.create", "_init_agent_loop_workers", _NONE),
            _call_sites(_MAIN, "TaskRunnerV1.init_agent_loop_manager", "create", _CREATE, keyword="llm_client"),
            _attrs(f"{_MAIN}:TaskRunnerV1", "__ray_actor_class__")), "v1"),
    _P("v1-trainer-step", f"{_V1T}:PPOTrainer.step, PPOTrainer._validate",
       "wrapped at class level: `step(self, metrics, timing_raw)`, `_validate(self)`, called by `fit`, which sets "
       "`self.agent_loop_manager`; no registered trainer overrides them", (_HOOKS,),
       _all(_sig(f"{_V1T}:PPOTrainer.step", "self", {}, {}), _sig(f"{_V1T}:PPOTrainer._validate", "self"),
            _call_sites(_V1T, "PPOTrainer.fit", "self.step", inspect.signature(lambda metrics, timing_raw: None)),
            _call_sites(_V1T, "PPOTrainer.fit", "self._validate", _NONE),
            _mentions(_V1T, "PPOTrainer.fit", "agent_loop_manager", stored=True)), "v1"),
    _P("v1-phase-hooks", f"{_V1T}:PPOTrainer.on_sample_end, on_step_end",
       "wrapped per trainer: `on_sample_end(self)`, `on_step_end(self)`; `parameter_sync_step`, `local_trigger_step`, "
       "`global_steps` read", (_HOOKS,),
       _all(_sig(f"{_V1T}:PPOTrainer.on_sample_end", "self"), _sig(f"{_V1T}:PPOTrainer.on_step_end", "self"),
            _mentions(_V1T, "PPOTrainer", "parameter_sync_step", "local_trigger_step", "global_steps",
                      stored=True)), "v1"),
    _P("v1-trainer-modes", f"{_V1T}:TRAINER_REGISTRY, get_trainer_cls",
       "the modes are `V1_TRAINER_MODES` (sync, colocate_async, separate_async); `get_trainer_cls(name)`",
       (_CHECKS, "testing/trainer_run.py"),
       _all(_check(_v1_modes, lambda: f"TRAINER_REGISTRY {sorted(_get(f'{_V1T}:TRAINER_REGISTRY'))}, or a mode that "
                                      "overrides step or _validate"), _sig(f"{_V1T}:get_trainer_cls", "sync")), "v1"),
    _P("v1-config", "trainer.v1.trainer_mode, trainer.v1.sampler.*",
       "`trainer_mode=sync`, `sampler.sync_refill_failed_groups=False` (on_error=drop in sync mode needs it true), "
       "`sampler.custom_sampler.{path,name}`, `sampler.sampler_kwargs`", (_CHECKS, "testing/replay_buffer.py"),
       _config({"trainer.v1.trainer_mode": "sync", "trainer.v1.sampler.sync_refill_failed_groups": False,
                "trainer.v1.sampler.custom_sampler.path": None, "trainer.v1.sampler.custom_sampler.name": None,
                "trainer.v1.sampler.sampler_kwargs": _ANY}), "v1"),
    _P("v1-testing", "verl.trainer.ppo.v1: ReplayBuffer(Async), PPOTrainer's private methods; tensordict_utils",
       "(testing, demo) replay buffers subclassed (`sampler_kwargs`, `poll_interval`, `sample(global_steps=, ...)`); "
       "`PPOTrainer._build_replay_buffer` & co. called; `get_tensordict`, `assign_non_tensor_data`",
       ("testing/replay_buffer.py", "testing/v1.py", "testing/trainer_run.py", "demo/sampler.py"),
       _all(_sig("verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync.sample", "self", global_steps=1,
                 partition_id="train", batch_size=1),
            _mentions("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer.__init__", "sampler_kwargs", "poll_interval",
                      stored=True),
            _attrs(f"{_V1T}:PPOTrainer", "_build_replay_buffer", "_resolve_filter_groups_metric",
                   "_submit_batch_to_rollout", "_add_prompts_to_generate"),
            _sig(f"{_V1T}:PPOTrainer._compute_metrics", "self", None, {}, {}, global_steps=1, epoch=0),
            _sig("verl.utils.tensordict_utils:get_tensordict", tensor_dict={}),
            _sig("verl.utils.tensordict_utils:assign_non_tensor_data", None, "k", 1)), "v1"),
)


# --- running them -----------------------------------------------------------------------------------------------------

@functools.cache
def gate(group: str) -> str | None:
    """Why ``group``'s touch points cannot be checked here (``"v1 not importable (...)"``), or None."""
    if group == "vllm" and importlib.util.find_spec("vllm") is None:
        return "vLLM not installed"
    if group == "v1":
        try:
            importlib.import_module("verl.trainer.ppo.v1")
        except Exception as exc:  # noqa: BLE001 - neo: ModuleNotFoundError; without TransferQueue: ImportError
            return f"v1 not importable ({type(exc).__name__}: {exc})"
    return None


def check(point: TouchPoint) -> Result:
    """Check one touch point against the installed verl; never raises for what verl has."""
    if (closed := gate(point.group)) is not None:
        return Result(point, "unavailable", closed)
    try:
        point.check()
    except _Changed as exc:
        return Result(point, "changed", str(exc))
    except Exception as exc:  # noqa: BLE001 - an import or a shape the check did not foresee: verl changed either way
        return Result(point, "changed", f"{type(exc).__name__}: {exc}")
    return Result(point, "ok")


def run_checks(points: tuple[TouchPoint, ...] = TOUCH_POINTS) -> list[Result]:
    """Every touch point's :class:`Result`, in the list's order."""
    return [check(point) for point in points]
