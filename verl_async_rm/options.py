"""The one mechanism that types config fields: :func:`option` declares a field (default, help, type, bounds or
choices), :func:`check_options`, first in ``__post_init__``, checks them all, raising ``ConfigValueError`` under the
field's name; :func:`select` reads one key of verl's config."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from verl_async_rm.errors import ConfigTypeError, ConfigValueError

__all__ = ["option", "check_options", "select", "Rule"]

_NAMES = {int: "an integer", float: "a finite number", str: "a non-empty string", bool: "true or false",
          tuple: "a list of non-empty strings", dict: "a mapping from names to finite numbers",
          object: "a mapping from names to JSON values"}


@dataclass(frozen=True)
class Rule:
    """What a field accepts: ``value_type`` (a float field takes ints; strings must not be empty; ``tuple``: non-empty
    strings; ``dict``: names to numbers, stored as ``(name, float)`` pairs so the dataclass stays hashable; ``object``:
    names to JSON values, stored as the JSON text of the mapping, keys sorted), None when
    ``optional``, ``choices``, bounds; ``why``/``fix`` replace the generated words (``{key}``: the key reported)."""

    value_type: type
    optional: bool = False
    choices: tuple[Any, ...] | None = None
    least: float | None = None
    most: float | None = None
    above: float | None = None
    why: str | None = None
    fix: str | None = None

    def convert(self, key: str, value: Any) -> Any:
        """``value`` checked (a float field's value as a float); raises ``ConfigValueError`` under ``key``."""
        if value is None and self.optional:
            return None
        cls = self.value_type
        if cls in (tuple, dict):
            return self._collection(key, value)
        if cls is object:
            return self._json(key, value)
        if cls is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            ok = isinstance(value, cls) and (cls is bool or not isinstance(value, bool))
        if not ok or (cls is str and not value):
            raise ConfigTypeError(key, value, self.why or f"must be {self._expected()}", self._fix())
        if cls is float:
            value = float(value)
        bad = (cls is float and not math.isfinite(value)) or (self.choices is not None and value not in self.choices)
        bad = bad or (self.least is not None and value < self.least) or (self.most is not None and value > self.most)
        if bad or (self.above is not None and not value > self.above):
            why = "unknown value" if self.choices is not None else f"{{key}} must be {self._bounds()}, got {value!r}"
            raise ConfigValueError(key, value, self.why or why, self._fix())
        return value

    def _collection(self, key: str, value: Any) -> tuple:
        """A list of non-empty strings as a tuple, or a mapping (or its pairs) of strings to finite numbers as
        ``((name, float), ...)``; an OmegaConf ``ListConfig``/``DictConfig`` is read as a list/mapping."""
        items = list(value.items()) if isinstance(value, Mapping) else value
        ok = isinstance(items, Sequence) and not isinstance(items, str | bytes) and len(items) > 0
        if ok and self.value_type is tuple:
            ok = all(isinstance(v, str) and v for v in items)
            converted = tuple(items) if ok else ()
        elif ok:
            pairs = [tuple(p) if isinstance(p, Sequence) and not isinstance(p, str) else None for p in items]
            ok = all(p is not None and len(p) == 2 and isinstance(p[0], str) and p[0]
                     and isinstance(p[1], int | float) and not isinstance(p[1], bool) and math.isfinite(p[1])
                     for p in pairs)
            converted = tuple((p[0], float(p[1])) for p in pairs) if ok else ()  # type: ignore[index]
        if not ok:
            raise ConfigTypeError(key, value, self.why or f"must be {self._expected()}", self._fix())
        return converted

    def _json(self, key: str, value: Any) -> str:
        """A mapping (or its JSON text) of names to JSON values, as its JSON text."""
        from omegaconf import DictConfig, OmegaConf

        try:
            if isinstance(value, DictConfig):
                value = OmegaConf.to_container(value, resolve=True)
            mapping = json.loads(value) if isinstance(value, str) else value
            if isinstance(mapping, Mapping) and mapping and all(isinstance(k, str) and k for k in mapping):
                return json.dumps(dict(mapping), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            pass
        raise ConfigTypeError(key, value, self.why or f"must be {self._expected()}", self._fix())

    def _expected(self) -> str:
        bounds = self._bounds()
        return _NAMES[self.value_type] + (f" {bounds}" if bounds else "") + (" or None" if self.optional else "")

    def _bounds(self) -> str:
        if self.least is not None and self.most is not None:
            return f"in [{self.least:g}, {self.most:g}]"
        parts = [f">= {self.least:g}" if self.least is not None else "", f"> {self.above:g}" if self.above is not None
                 else "", f"<= {self.most:g}" if self.most is not None else ""]
        return " and ".join(p for p in parts if p) or ("finite" if self.value_type is float else "")

    def _fix(self) -> str:
        return self.fix or (f"use one of {self.choices}" if self.choices is not None else
                            f"set {{key}} to {self._expected()}")


def option(default: Any, help: str, value_type: type | None = None,  # noqa: A002 - help: the metadata key
           **rule: Any) -> Any:
    """A dataclass field with ``help`` metadata and a :class:`Rule` (``value_type`` defaults to the default's type)."""
    return field(default=default, metadata={"help": help, "rule": Rule(value_type or type(default), **rule)})


def check_options(obj: Any, prefix: str = "") -> None:
    """Check (and convert) every field of the frozen dataclass ``obj`` that has a rule; keys are ``prefix + name``."""
    for f in fields(obj):
        if (rule := f.metadata.get("rule")) is not None:
            value = getattr(obj, f.name)
            if (converted := rule.convert(prefix + f.name, value)) is not value:
                object.__setattr__(obj, f.name, converted)


def select(config: Any, key: str) -> Any:
    """``config[key]`` for a dotted key, or None when any part is missing (a ``DictConfig`` or nested mappings)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(config, DictConfig):
        return OmegaConf.select(config, key, default=None)
    node = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
