"""The source of proxy/config/sections.py, written from the schema (proxy/config/schema.py).

Every `Section` of the schema gets a frozen class whose fields are its keys, in order, named
by its path (`balance` -> Balance, `routing.affinity` -> RoutingAffinity, `workers[]` ->
Workers, the root -> Root). The classes are source, not made at import, so a type checker
sees `config.balance.lease_commit_ms` as a float. `responses-proxy config sections` prints the
module; tests/config/test_schema.py keeps the checked-in one equal to it, and
proxy/config/settings.py refuses to build settings from classes that differ from the schema.

This module imports the schema alone (never sections.py or settings.py), so the command still
runs while sections.py is stale, or empty because the shell truncated it for the redirect.
"""

from __future__ import annotations

import re
import textwrap

from proxy.config.schema import SCHEMA
from proxy.config.types import OMIT, Bool, Either, Int, Key, ListOf, MapOf, Nullable, Num, Section, Str, Type, Url

COMMAND = "responses-proxy config sections > proxy/config/sections.py"

_WIDTH = 120  # ruff's line length


def class_name(path: str) -> str:
    parts = path.replace("[]", "").split(".") if path else ["root"]
    return "".join(part.title().replace("_", "") for part in parts)


def inner_sections(t: Type, path: str) -> list[tuple[Section, str]]:
    """The sections a key's type holds, with their paths (`[]` for an entry of a list or a mapping)."""
    if isinstance(t, Section):
        return [(t, path)]
    if isinstance(t, Nullable):
        return inner_sections(t.inner, path)
    if isinstance(t, (ListOf, MapOf)):
        return inner_sections(t.item if isinstance(t, ListOf) else t.value, path + "[]")
    return []


def sections() -> list[tuple[str, Section]]:
    """Every section with its path, inner ones before the section holding them, the root last.
    A section reached twice keeps the path it was first reached by (its one class)."""
    found: dict[int, tuple[str, Section]] = {}

    def visit(section: Section, path: str) -> None:
        if id(section) in found:
            return
        for name, key in section.keys.items():
            for inner, where in inner_sections(key.type, f"{path}.{name}" if path else name):
                visit(inner, where)
        found[id(section)] = (path, section)

    visit(SCHEMA, "")
    return list(found.values())


def class_names() -> dict[int, str]:
    """Each section's class name by the id of the section."""
    return {id(section): class_name(path) for path, section in sections()}


def annotation(t: Type, names: dict[int, str] | None = None) -> str:
    names = class_names() if names is None else names
    if isinstance(t, Section):
        return names[id(t)]
    if isinstance(t, Nullable):
        return f"{annotation(t.inner, names)} | None"
    if isinstance(t, ListOf):  # lists are tuples in the frozen settings
        return f"tuple[{annotation(t.item, names)}, ...]"
    if isinstance(t, MapOf):
        return f"dict[str, {annotation(t.value, names)}]"
    if isinstance(t, Either):
        return " | ".join(annotation(o, names) for o in t.options)
    return {Int: "int", Num: "float", Bool: "bool", Str: "str", Url: "str"}.get(type(t), "Any")


def field_annotation(key: Key, names: dict[int, str] | None = None) -> str:
    """A key's annotation in its class: an `OMIT` key left out is None, so it may be None."""
    text = annotation(key.type, names)
    if key.default is OMIT and not text.endswith(" | None") and text != "Any":
        text += " | None"
    return text


HEADER = f'''\
"""The typed settings of config.yaml: one frozen class per section of the schema.

Generated from proxy/config/schema.py by `{COMMAND}`
(proxy/config/codegen.py); edit the schema, not this file. tests/config/test_schema.py keeps
the two equal, and proxy/config/settings.py refuses to build settings from a stale copy.
A field's comment is its key's doc in the schema. Other modules import these classes for
annotations only (under TYPE_CHECKING), so the command that regenerates this file runs while
it is stale, or empty (the shell truncates it for the redirect).
"""

from __future__ import annotations

from dataclasses import dataclass
'''


def _docstring(path: str) -> str:
    return f'    """The `{path}` section."""' if path else '    """The whole configuration (`Config.settings`)."""'


def _field(name: str, ann: str, doc: str) -> list[str]:
    line = f"    {name}: {ann}"
    if not doc:
        return [line]
    if len(line) + 4 + len(doc) <= _WIDTH:
        return [f"{line}  # {doc}"]
    comment = textwrap.wrap(doc, _WIDTH, initial_indent="    # ", subsequent_indent="    # ",
                            break_long_words=False, break_on_hyphens=False)
    return [*comment, line]


def _class(path: str, section: Section, names: dict[int, str]) -> list[str]:
    lines = ["", "", "@dataclass(frozen=True, slots=True, kw_only=True)", f"class {class_name(path)}:",
             _docstring(path), ""]
    for name, key in section.keys.items():
        lines += _field(name, field_annotation(key, names), key.doc)
    return lines


def source() -> str:
    """The text of proxy/config/sections.py."""
    names = class_names()
    body: list[str] = []
    for path, section in sections():
        body += _class(path, section, names)
    body += ["", "", "class Sections:",
             '    """The root\'s keys as attributes of Config (proxy/config/load.py): `config.balance`."""', ""]
    body += [f"    {name}: {field_annotation(key, names)}" for name, key in SCHEMA.keys.items()]
    uses_any = any(re.search(r"^    \w+: .*\bAny\b", line) for line in body)
    head = HEADER + ("from typing import Any\n" if uses_any else "")
    return head + "\n".join(body) + "\n"
