"""The options reference (``docs/reference/options.md``), written from the config dataclasses' help metadata.

The page is a file of the repository, so that links to it work where the site is not built (on GitHub); it must not
drift from the code: ``python docs/hooks/gen_options.py`` rewrites it, ``tests/unit/test_docs_site.py`` fails when it
is stale, and mkdocs, which runs this module as a hook (``hooks:`` in ``mkdocs.yml``), warns (an error with
``--strict``). Each row is one dataclass field: the key the user writes, its type, its default and its ``help``
metadata; fields with ``metadata={"internal": True}`` are not user keys and are left out.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import logging
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

#: The committed page.
PAGE = Path(__file__).resolve().parents[1] / "reference" / "options.md"
#: How to bring the page up to date (said by the test and the hook).
REGENERATE = "python docs/hooks/gen_options.py"
if __name__ == "__main__":  # run as a script: render this checkout's package, not another installed copy
    sys.path.insert(0, str(PAGE.parents[2]))

# ----------------------------------------------------------------------------------------------------------------------
# Where each user key lives in the code. This is the only part to change when the config moves or is refactored.


class Group(NamedTuple):
    title: str
    cls: str  # "module:Class", a dataclass whose fields carry metadata={"help": ...}
    key: str  # the user key of a field; {field} is the field's name
    intro: str


#: Titles and introductions, by class name; the classes themselves and their key prefix come from the code
#: (``verl_async_rm.config.option_groups()``), so a class added there without a title here fails the build.
TITLES = {
    "BatchPolicy": ("Batching", "How each RM's requests are batched (the RM service's batcher)."),
    "RMConfig": ("Reward model", "How the RM is loaded, fed and placed. The path and the pool's size are verl's own "
                                 "keys."),
    "RewardMix": ("Reward mix", "How the RM scores and the reward manager's reward make one reward."),
    "IntegrationConfig": ("Integration", "The agent-loop integration: the trajectory's wait, what a failed score "
                                         "does, the service actor."),
}


def _groups() -> list[Group]:
    from verl_async_rm.config import CONFIG_GROUP, option_groups

    prefix = f"{CONFIG_GROUP}."
    return [Group(*TITLES[cls.__name__][:1], f"{cls.__module__}:{cls.__name__}", prefix + "{field}",
                  TITLES[cls.__name__][1]) for cls in option_groups()[prefix]]


GROUPS = _groups()
#: Fields whose user key is not the group's: verl's own keys ("Class.field" -> key).
KEY_OVERRIDES = {
    "RMConfig.model_path": "reward.reward_model.model_path",
    "RMConfig.n_gpus_per_node": "reward.reward_model.n_gpus_per_node",
    "RMConfig.nnodes": "reward.reward_model.nnodes",
    "RMConfig.use_gpu": "trainer.device",
}
#: Defaults shown instead of the dataclass's, where the value comes from elsewhere ("Class.field" -> Markdown).
DEFAULT_OVERRIDES = {
    "RMConfig.model_path": "required, unless `async_rm.endpoint` (verl's default: `null`)",
    "RMConfig.n_gpus_per_node": "verl's: `8`",
    "RMConfig.nnodes": "verl's: `0`, so set it",
    "RMConfig.use_gpu": "GPU replicas (`use_gpu=True`) unless `trainer.device=cpu`",
    "RMConfig.policy_tokenizer_path": "`actor_rollout_ref.model.tokenizer_path`, else `actor_rollout_ref.model.path`",
    "RewardMix.rule_weight": "`0.0` with `reward.reward_manager.name=async_rm`, `1.0` with any other manager",
}
#: Extra RMs (``async_rm.models.<name>.<key>``): the key, the RM's own keys (never taken from the top of
#: ``async_rm``) with their defaults, the RM options not set per RM, and the classes whose fields an extra RM may set.
MODEL_KEY = "async_rm.models.<name>.{field}"
MODEL_OWN = {"model_path": "required, unless `endpoint`", "n_gpus_per_node": "`1`", "nnodes": "`1`",
             "gpus_per_replica": "`1`", "endpoint": "`None`", "endpoint_model": "`None`", "api_key_env": "`None`",
             "max_concurrency": "`None`", "max_rpm": "`None`", "max_tpm": "`None`"}
MODEL_WEIGHT_HELP = "Its weight in the reward (`main`, the RM of `reward.reward_model.*`, is weighted by " \
                    "`async_rm.rm_weight`)."
MODEL_NOT_PER_RM = ("use_gpu",)
MODEL_CLASSES = ("RMConfig", "BatchPolicy")
# ----------------------------------------------------------------------------------------------------------------------


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _options(group: Group) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(_load(group.cls)) if not f.metadata.get("internal")]


def user_keys() -> dict[tuple[str, str], str]:
    """``{(class name, field name): user key}`` for every documented field, in page order."""
    keys = {}
    for group in GROUPS:
        name = group.cls.split(":")[1]
        for f in _options(group):
            keys[(name, f.name)] = KEY_OVERRIDES.get(f"{name}.{f.name}", group.key.format(field=f.name))
    return keys


def _text(value: str) -> str:
    """Help text as Markdown table-cell text: no HTML, no emphasis, no cell breaks."""
    value = " ".join(value.split())
    value = re.sub(r"([\\*_|\[\]])", r"\\\1", value)
    return html.escape(value, quote=False)


def _type(f: dataclasses.Field) -> str:
    """``int | None`` as "`int` or `None`": a pipe would end the table cell."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kind = re.sub(r"^Optional\[(.*)\]$", r"\1 | None", kind)
    return " or ".join(f"`{part.strip()}`" for part in kind.split("|"))


def _default(f: dataclasses.Field, name: str) -> str:
    if f"{name}.{f.name}" in DEFAULT_OVERRIDES:
        return DEFAULT_OVERRIDES[f"{name}.{f.name}"]
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def render() -> str:
    keys = user_keys()
    out = [
        "# Options reference",
        "",
        f"<!-- Generated by docs/hooks/gen_options.py from the config dataclasses' help metadata: do not edit, run "
        f"{REGENERATE}. -->",
        "",
        "Every key the plugin reads, generated from the help text of its config dataclasses, so it cannot fall "
        "behind the code. All `async_rm.*` keys are optional and written with a `+` on verl's command line "
        "(`+async_rm.max_batch_size=64`); unknown keys are refused. The ones you are likely to touch: [Opt in]"
        "(../guide/opt-in.md#the-keys-you-are-likely-to-touch).",
        "",
    ]
    for group in GROUPS:
        name = group.cls.split(":")[1]
        out += [f"## {group.title}", "", f"{group.intro} Class: `{group.cls.replace(':', '.')}`.", "",
                "| key | type | default | help |", "|---|---|---|---|"]
        for f in _options(group):
            key = keys[(name, f.name)]
            out.append(f"| `{key}` | {_type(f)} | {_default(f, name)} | "
                       f"{_text(f.metadata.get('help', ''))} |")
        out.append("")
    out += [
        "## Extra RMs",
        "",
        f"Each extra RM is a group of keys under its name, `+{MODEL_KEY.format(field='<key>')}=...` (a name starts "
        "with a letter and holds letters, digits and `_`; `main` is taken). Its own keys, never taken from the main "
        "RM's keys or the top of `async_rm`:",
        "",
        "| key | default | help |",
        "|---|---|---|",
    ]
    by_name = {f.name: f for group in GROUPS if group.cls.split(":")[1] in MODEL_CLASSES for f in _options(group)}
    for field_name, default in MODEL_OWN.items():
        out.append(f"| `{MODEL_KEY.format(field=field_name)}` | {default} | "
                   f"{_text(by_name[field_name].metadata.get('help', ''))} |")
    out.append(f"| `{MODEL_KEY.format(field='weight')}` | `1.0` | {MODEL_WEIGHT_HELP} |")
    others = sorted(set(by_name) - set(MODEL_OWN) - set(MODEL_NOT_PER_RM)
                    - {k.split(".")[1] for k in KEY_OVERRIDES})
    out += [
        "",
        "Every other key of the tables above may also be set per RM, with the default the value set at the top "
        "(`async_rm.<key>`), else the table's default: " + ", ".join(f"`{k}`" for k in others) + ".",
        "",
    ]
    return "\n".join(out)


def is_current() -> bool:
    """Whether the committed page is what the code renders now."""
    return PAGE.is_file() and PAGE.read_text(encoding="utf-8") == render()


def write() -> bool:
    """Write the page from the code; whether it changed."""
    if is_current():
        return False
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render(), encoding="utf-8")
    return True


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: warn (an error with ``--strict``) when the committed page is not what the code renders."""
    if not is_current():
        logging.getLogger("mkdocs.hooks.gen_options").warning(
            "docs/reference/options.md does not match the config dataclasses' help metadata: run %s", REGENERATE)
    return files


if __name__ == "__main__":
    print(f"{PAGE}: {'rewritten' if write() else 'already current'}")
