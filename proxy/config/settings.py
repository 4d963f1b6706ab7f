"""The settings instances: the checked configuration built into the classes of proxy/config/sections.py.

`build(data)` turns a configuration checked by proxy/config/schema.py into the `Root` instance
that `Config` exposes (`config.balance.lease_commit_ms`). A key left out takes its class's
default (a COMMENTED key's too, or the key its `DefaultFrom` names); a key whose default is off
is None. Lists become tuples; numbers of a float key are floats. Mappings (labels, prices, keys
by id) stay dicts: the instances are frozen, their free-form mappings are read-only by
convention. Sections of operators' own middlewares have no class: their factory gets the raw
mapping (middlewares/__init__.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.config.schema import SCHEMA, defaults, sections_by_path
from proxy.config.types import OMIT, REQUIRED, ListOf, MapOf, Nullable, Num, SchemaError, Section, Type

if TYPE_CHECKING:
    from proxy.config.sections import Root

_DEFAULTS = defaults()
_SECTIONS = sections_by_path()  # "routing.affinity" -> its Section


def _value(t: Type, value: Any, root: dict[str, Any] | None = None) -> Any:
    if value is None:
        return None
    if isinstance(t, Section):
        return _section(t, value, root)
    if isinstance(t, Nullable):
        return _value(t.inner, value, root)
    if isinstance(t, ListOf):
        return tuple(_value(t.item, v, root) for v in value)
    if isinstance(t, MapOf):
        return {k: _value(t.value, v, root) for k, v in value.items()}
    if isinstance(t, Num):
        return float(value)
    return value


def _lookup(root: dict[str, Any], path: str) -> Any:
    value: Any = root
    for part in path.split("."):
        value = value[part]
    return value


def _section(section: Section, data: dict[str, Any], root: dict[str, Any] | None = None) -> Any:
    values = {}
    for name, key in section.keys.items():
        if name in data:
            values[name] = _value(key.type, data[name], root)
        elif key.default_from and root is not None:
            values[name] = _value(key.type, _lookup(root, key.default_from))
        elif isinstance(key.type, Section) and key.default is None:
            values[name] = _section(key.type, {}, root)
        elif key.default is OMIT:
            values[name] = None
        elif key.default is REQUIRED:  # the schema check refused this before
            raise SchemaError(f"{name!r} is required")
        else:
            values[name] = _value(key.type, key.default)
    return section.cls(**values)


def build(data: dict[str, Any]) -> Root:
    """The settings of a checked configuration (proxy.config.schema.validate's result)."""
    root: Root = _section(SCHEMA, data, data)
    return root


def of(path: str, raw: dict[str, Any] | None = None) -> Any:
    """One section's settings from a mapping of its keys (the rest at their defaults), checked
    as the start-up check would: `of("routing.affinity", {"vnodes": 8})`. For tests and tools
    that need one section without a whole configuration (a default taken from another key
    takes that key's default). A type checker sees Any: annotate the result with the section's
    class (`_ENTRY: Workers = of("workers[]", ...)`)."""
    section = _SECTIONS[path]
    return _section(section, section.check(raw or {}, path), _DEFAULTS)


def classes() -> dict[str, type]:
    """Every section's class by its path ("" is the root)."""
    return {path: section.cls for path, section in _SECTIONS.items()}
