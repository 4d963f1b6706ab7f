"""The typed settings: one frozen dataclass per section of the schema, made from it.

Every `Section` of proxy/config/schema.py gets a class whose fields are its keys, in order
(named by its path: `balance` -> Balance, `routing.affinity` -> RoutingAffinity,
`workers[]` -> Workers). `build(data)` turns the checked configuration into the `Root`
instance that `Config` exposes (`config.balance.lease_commit_ms`). A key left out takes its
schema default, an `Opt` key's included: the default in force is the one the schema writes,
so no module restates it. A key whose default is `OMIT` (absent means off) is None.

Lists become tuples; numbers of a `Num` key are floats. Mappings (labels, prices, keys by
id) stay dicts: the dataclasses are frozen, their free-form mappings are read-only by
convention. Sections of operators' own middlewares are not in the schema: their factory
gets the raw mapping (middlewares/__init__.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from proxy.config.schema import SCHEMA
from proxy.config.types import (
    OMIT,
    REQUIRED,
    Bool,
    Either,
    Int,
    ListOf,
    MapOf,
    Nullable,
    Num,
    SchemaError,
    Section,
    Str,
    Type,
    Url,
)

_CLASSES: dict[int, type] = {}  # id(Section) -> its class
_BY_PATH: dict[str, type] = {}  # "routing.affinity" -> its class


def _class_name(path: str) -> str:
    parts = path.replace("[]", "").split(".") if path else ["root"]
    return "".join(part.title().replace("_", "") for part in parts)


def _annotation(t: Type) -> str:
    if isinstance(t, Section):
        return _CLASSES[id(t)].__name__
    if isinstance(t, Nullable):
        return f"{_annotation(t.inner)} | None"
    if isinstance(t, ListOf):
        return f"tuple[{_annotation(t.item)}, ...]"
    if isinstance(t, MapOf):
        return f"dict[str, {_annotation(t.value)}]"
    if isinstance(t, Either):
        return " | ".join(_annotation(o) for o in t.options)
    return {Int: "int", Num: "float", Bool: "bool", Str: "str", Url: "str"}.get(type(t), "Any")


def _inner_sections(t: Type, path: str) -> list[tuple[Section, str]]:
    if isinstance(t, Section):
        return [(t, path)]
    if isinstance(t, Nullable):
        return _inner_sections(t.inner, path)
    if isinstance(t, (ListOf, MapOf)):
        return _inner_sections(t.item if isinstance(t, ListOf) else t.value, path + "[]")
    return []


def _make(section: Section, path: str) -> type:
    if id(section) in _CLASSES:
        return _CLASSES[id(section)]
    for name, key in section.keys.items():
        for inner, where in _inner_sections(key.type, f"{path}.{name}" if path else name):
            _make(inner, where)
    fields = [(name, _annotation(key.type), dataclasses.field(metadata={"doc": key.doc}))
              for name, key in section.keys.items()]
    cls = dataclasses.make_dataclass(_class_name(path), fields, frozen=True, slots=True, kw_only=True)
    cls.__module__ = __name__
    globals()[cls.__name__] = cls  # importable by name (pickle, copy): settings.Balance
    _CLASSES[id(section)] = cls
    _BY_PATH[path] = cls
    return cls


Root = _make(SCHEMA, "")
_DEFAULTS = SCHEMA.defaults()


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
    return _CLASSES[id(section)](**values)


def build(data: dict[str, Any]) -> Any:
    """The typed settings of a checked configuration (proxy.config.schema.validate's result)."""
    return _section(SCHEMA, data, data)


def of(path: str, raw: dict[str, Any] | None = None) -> Any:
    """One section's settings from a mapping of its keys (the rest at their defaults), checked
    as the start-up check would: `of("routing.affinity", {"vnodes": 8})`. For tests and tools
    that need one section without a whole configuration (a default taken from another key
    takes that key's default)."""
    cls = _BY_PATH[path]
    section = next(s for s in _section_types() if _CLASSES[id(s)] is cls)
    return _section(section, section.check(raw or {}, path), _DEFAULTS)


def _section_types() -> list[Section]:
    found: list[Section] = []

    def walk(section: Section) -> None:
        found.append(section)
        for key in section.keys.values():
            for inner, _ in _inner_sections(key.type, ""):
                walk(inner)

    walk(SCHEMA)
    return found


def classes() -> dict[str, type]:
    """Every section's class by its path ("" is the root)."""
    return dict(_BY_PATH)
