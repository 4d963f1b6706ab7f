"""The typed settings: one frozen dataclass per section of the schema, built from the checked data.

Every `Section` of proxy/config/schema.py has a class whose fields are its keys, in order
(named by its path: `balance` -> Balance, `routing.affinity` -> RoutingAffinity,
`workers[]` -> Workers, the root -> Root). The classes are source, generated from the schema
into proxy/config/sections.py (`responses-proxy config sections`, proxy/config/codegen.py), so a
type checker knows every key; this module finds each section's class there by name and
refuses to build settings while the two differ. `build(data)` turns the checked
configuration into the `Root` instance that `Config` exposes (`config.balance.lease_commit_ms`).
A key left out takes its schema default, an `Opt` key's included: the default in force is
the one the schema writes, so no module restates it. A key whose default is `OMIT` (absent
means off) is None.

Lists become tuples; numbers of a `Num` key are floats. Mappings (labels, prices, keys by
id) stay dicts: the dataclasses are frozen, their free-form mappings are read-only by
convention. Sections of operators' own middlewares are not in the schema: their factory
gets the raw mapping (middlewares/__init__.py).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import TYPE_CHECKING, Any

from proxy.config import codegen, sections
from proxy.config.schema import SCHEMA
from proxy.config.types import OMIT, REQUIRED, ListOf, MapOf, Nullable, Num, SchemaError, Section, Type

if TYPE_CHECKING:
    from proxy.config.sections import Root


def _problems(module: ModuleType) -> list[str]:
    """Where the classes of `module` differ from the schema: a class missing, not frozen with
    slots and keyword-only fields, or with other fields (names, order, annotations)."""
    names = codegen.class_names()
    problems: list[str] = []
    for path, section in codegen.sections():
        name = codegen.class_name(path)
        cls = getattr(module, name, None)
        if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
            problems.append(f"no class {name}")
            continue
        fields = dataclasses.fields(cls)
        params = cls.__dataclass_params__  # type: ignore[attr-defined]  # @dataclass sets it; typeshed omits it
        if not (params.frozen and "__slots__" in vars(cls) and all(f.kw_only for f in fields)):
            problems.append(f"{name} is not frozen, slotted and keyword-only")
        found = [(f.name, f.type) for f in fields]
        wanted = [(key_name, codegen.field_annotation(key, names)) for key_name, key in section.keys.items()]
        if found != wanted:
            problems.append(f"{name}: {_differ(found, wanted)}")
    typed = getattr(getattr(module, "Sections", None), "__annotations__", None)
    if typed != {name: codegen.field_annotation(key, names) for name, key in SCHEMA.keys.items()}:
        problems.append("Sections is not the root's keys")
    return problems


def _differ(found: list[tuple[str, Any]], wanted: list[tuple[str, str]]) -> str:
    for have, want in zip(found, wanted):
        if have != want:
            return f"{have[0]}: {have[1]} where the schema has {want[0]}: {want[1]}"
    if len(found) < len(wanted):
        return f"no field {wanted[len(found)][0]}, which the schema has"
    return f"a field {found[len(wanted)][0]}, which the schema does not have"


def _bind(module: ModuleType) -> tuple[dict[int, type], dict[str, type], str]:
    """Each section's class (by the section's id and by its path), or why they cannot be used.

    A stale module is refused when settings are built, not at import: the command that
    regenerates it imports this module (the CLI's), with sections.py stale or truncated."""
    problems = _problems(module)
    if problems:
        return {}, {}, (f"proxy/config/sections.py does not match the schema ({'; '.join(problems)}): "
                        f"regenerate it with `{codegen.COMMAND}`")
    by_id = {id(section): getattr(module, codegen.class_name(path)) for path, section in codegen.sections()}
    return by_id, {path: by_id[id(section)] for path, section in codegen.sections()}, ""


_CLASSES, _BY_PATH, _STALE = _bind(sections)  # id(Section) -> its class; "routing.affinity" -> its class
globals().update({cls.__name__: cls for cls in _BY_PATH.values()})  # importable by name too: settings.Balance


def _ready() -> None:
    if _STALE:
        raise RuntimeError(_STALE)


_DEFAULTS = SCHEMA.defaults()
_SECTIONS = dict(codegen.sections())  # "routing.affinity" -> its Section


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


def build(data: dict[str, Any]) -> Root:
    """The typed settings of a checked configuration (proxy.config.schema.validate's result)."""
    _ready()
    root: Root = _section(SCHEMA, data, data)
    return root


def of(path: str, raw: dict[str, Any] | None = None) -> Any:
    """One section's settings from a mapping of its keys (the rest at their defaults), checked
    as the start-up check would: `of("routing.affinity", {"vnodes": 8})`. For tests and tools
    that need one section without a whole configuration (a default taken from another key
    takes that key's default). A type checker sees Any: annotate the result with the section's
    class from proxy/config/sections.py (`_ENTRY: Workers = of("workers[]", ...)`)."""
    _ready()
    section = _SECTIONS[path]
    return _section(section, section.check(raw or {}, path), _DEFAULTS)


def classes() -> dict[str, type]:
    """Every section's class by its path ("" is the root)."""
    _ready()
    return dict(_BY_PATH)
