"""The schema of config.yaml, read from the settings classes (proxy/config/sections.py).

`section_of(cls)` reads a settings class into a `Section`: each field a `Key` whose type is
the `Type` its `Annotated` metadata names or, where it names none, the one its annotation
gives (`infer`). Three things come from it, so they cannot disagree with the classes:
  * `defaults()`, the embedded configuration: every default not marked COMMENTED;
  * `validate(data)`, the start-up check of the merged file: an unknown key at any depth names
    its path and the nearest known key, a wrong type names its path and the expected type;
  * the commented reference, config.yaml itself, and the README's table (proxy/config/reference.py).
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any

from proxy.config.sections import POINTS, POLICIES, Root
from proxy.config.types import (
    COMMENTED,
    OMIT,
    REQUIRED,
    AnyValue,
    Bool,
    DefaultFrom,
    Either,
    Int,
    Key,
    ListOf,
    MapOf,
    Note,
    Nullable,
    Num,
    SchemaError,
    Section,
    Str,
    Type,
    plain_data,
    unknown_key,
)

__all__ = ["SCHEMA", "POINTS", "POLICIES", "section_of", "infer", "sections_by_path", "defaults", "validate",
           "to_data"]

_SCALARS: dict[Any, Type] = {str: Str(), int: Int(), float: Num(), bool: Bool(), Any: AnyValue()}
_READ: dict[type, Section] = {}  # each class read once: a section is one object wherever it is used


def infer(hint: Any) -> Type:
    """The Type an annotation gives by itself: `str` -> Str(), `tuple[X, ...]` -> ListOf(X),
    `dict[str, X]` -> MapOf(X), `X | None` -> Nullable(X), a settings class -> its Section."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return section_of(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in args if a is not type(None)]
        inner = infer(options[0]) if len(options) == 1 else Either(tuple(infer(a) for a in options))
        return Nullable(inner) if len(options) < len(args) else inner
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return ListOf(infer(args[0]))
    if origin is dict:
        return MapOf(infer(args[1]))
    raise TypeError(f"no config type for the annotation {hint!r}")


def _resolved(t: Any) -> Type:
    """A Type that names a settings class (`ListOf(Workers)`: a class stands for its Section) with
    each class read as its Section."""
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        return section_of(t)
    if isinstance(t, ListOf):
        return ListOf(_resolved(t.item), t.min_len)
    if isinstance(t, MapOf):
        return MapOf(_resolved(t.value))
    if isinstance(t, Nullable):
        return Nullable(_resolved(t.inner))
    return t


def _key(f: dataclasses.Field[Any], hint: Any) -> Key:
    meta = getattr(hint, "__metadata__", ())
    base = typing.get_args(hint)[0] if meta else hint
    given = [m for m in meta if isinstance(m, Type) or (isinstance(m, type) and dataclasses.is_dataclass(m))]
    t = _resolved(given[0]) if given else infer(base)
    doc = next((m for m in meta if isinstance(m, str)), "")
    note = next((m.text for m in meta if isinstance(m, Note)), "")
    default_from = next((m.path for m in meta if isinstance(m, DefaultFrom)), "")
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = REQUIRED
    if isinstance(t, Section) and dataclasses.is_dataclass(default):
        default = None  # a section at its defaults (the reference shows its keys)
    elif default is None and not isinstance(t, Nullable):
        default = OMIT  # absent means off
    elif default is not REQUIRED:
        default = to_data(default)
    return Key(t, default, doc, COMMENTED not in meta, note, default_from)


def section_of(cls: type) -> Section:
    """The settings class `cls` read as a Section (once: the same object every time)."""
    found = _READ.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        found = _READ[cls] = Section({}, cls)
        found.keys.update({f.name: _key(f, hints[f.name]) for f in dataclasses.fields(cls)})
    return found


def to_data(value: Any) -> Any:
    """A settings value as config.yaml data: instances as mappings (keys that are off left out),
    tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        keys = section_of(type(value)).keys
        return {name: to_data(getattr(value, name)) for name, key in keys.items()
                if not (getattr(value, name) is None and not isinstance(key.type, Nullable))}
    if isinstance(value, (tuple, list)):
        return [to_data(v) for v in value]
    if isinstance(value, dict):
        return {k: to_data(v) for k, v in value.items()}
    return value


SCHEMA = section_of(Root)


def _inner(t: Type, path: str) -> list[tuple[Section, str]]:
    """The sections a key's type holds, with their paths (`[]` for an entry of a list or a mapping)."""
    if isinstance(t, Section):
        return [(t, path)]
    if isinstance(t, Nullable):
        return _inner(t.inner, path)
    if isinstance(t, (ListOf, MapOf)):
        return _inner(t.item if isinstance(t, ListOf) else t.value, path + "[]")
    return []


def sections_by_path() -> dict[str, Section]:
    """Every section by its path ("" the root, "routing.affinity", "workers[]"), inner ones first."""
    found: dict[str, Section] = {}

    def visit(section: Section, path: str) -> None:
        for name, key in section.keys.items():
            for inner, where in _inner(key.type, f"{path}.{name}" if path else name):
                visit(inner, where)
        found.setdefault(path, section)

    visit(SCHEMA, "")
    return found


def defaults() -> dict[str, Any]:
    return copy.deepcopy(SCHEMA.defaults())


def _custom_names(middlewares: Any) -> set[str]:
    """The custom middlewares named at the points (their top-level sections are free-form)."""
    names = set()
    for entries in (middlewares or {}).values() if isinstance(middlewares, dict) else ():
        for entry in entries or ():
            names.add(entry if isinstance(entry, str) else next(iter(entry)))
    return names


def validate(data: dict[str, Any]) -> dict[str, Any]:
    """The merged configuration checked against SCHEMA (raises SchemaError)."""
    if not isinstance(data, dict):
        raise SchemaError("the top level must be a mapping")
    if "pipeline" in data:
        raise SchemaError("pipeline is no longer a setting: the phases' order is fixed; switch a built-in policy "
                          "with its section's `enabled` and put your own middlewares under `middlewares` "
                          "(after_auth, after_prepare, before_handler)")
    out: dict[str, Any] = {}
    if "middlewares" in data:
        out["middlewares"] = SCHEMA.keys["middlewares"].type.check(data["middlewares"], "middlewares")
    custom = _custom_names(out.get("middlewares"))
    for name, value in data.items():
        if name == "middlewares":
            continue
        if name in SCHEMA.keys:
            out[name] = SCHEMA.keys[name].type.check(value, name)
        elif name in custom:
            out[name] = plain_data(value)  # its factory checks it
        else:
            raise SchemaError(unknown_key(name, name, SCHEMA.keys))
    return out


