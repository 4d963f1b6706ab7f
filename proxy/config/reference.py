"""config.yaml's comments and the README's table of keys, written from the settings classes.

`reference()` is config.yaml itself: every key at its default with its doc, the COMMENTED ones
commented out, each section's note above it (`responses-proxy config reference`).
`markdown_table()` is the README's "Every key" table (`responses-proxy config reference
--markdown`). tests/config/test_schema.py keeps both equal to what is checked in.
"""

from __future__ import annotations

from typing import Any

import yaml

from proxy.config.schema import SCHEMA
from proxy.config.types import OMIT, REQUIRED, Key, ListOf, MapOf, Section

HEADER = """\
responses-proxy configuration, with every key at its default. Written from the settings
classes (proxy/config/sections.py) by `responses-proxy config reference`; a test keeps the two equal.
Every key is optional: what is left out takes its default. A key this file does not know
stops start-up, naming it. A value written "${NAME}" is read from the environment (an
unset NAME stops start-up), so secrets stay out of this file. Commented keys show the
default the code uses when they are left out."""

_COMMENT_COL = 28


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text[:-4].rstrip() if text.endswith("\n...") else text.removesuffix("...").strip()


def _line(indent: str, text: str, doc: str, commented: bool = False) -> list[str]:
    body = f"{indent}{'# ' if commented else ''}{text}"
    if not doc:
        return [body]
    return [f"{body.ljust(_COMMENT_COL - 1)} # {doc}" if len(body) < _COMMENT_COL - 1 else f"{body}  # {doc}"]


def _notes(indent: str, note: str) -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in note.splitlines()] if note else []


def _section_lines(section: Section, indent: str, commented: bool = False) -> list[str]:
    lines: list[str] = []
    for name, key in section.keys.items():
        off = commented or not key.embedded
        lines += _notes(indent, key.note)
        lines += _key_lines(name, key, indent, off)
    return lines


def _key_lines(name: str, key: Key, indent: str, commented: bool) -> list[str]:
    t = key.type
    if isinstance(t, Section) and key.default is None:
        return _line(indent, f"{name}:", key.doc, commented) + _section_lines(t, indent + "  ", commented)
    if isinstance(t, ListOf) and isinstance(t.item, Section):
        if key.default:
            lines = _line(indent, f"{name}:", key.doc, commented)
            for entry in key.default:
                lines += _item_lines(t.item, entry, indent + "  ", commented)
            return lines
        # An empty list: its entries' keys shown as a commented example.
        lines = _line(indent, f"{name}: {_flow(key.default)}", key.doc, commented)
        return lines + _item_lines(t.item, {}, indent + "  ", True)
    if isinstance(t, MapOf) and isinstance(key.default, dict) and key.default:
        lines = _line(indent, f"{name}:", key.doc, commented)
        for k, v in key.default.items():
            lines += _line(indent + "  ", f"{k}: {_flow(v)}", "", commented)
        return lines
    if key.default is REQUIRED:
        return _line(indent, f"{name}: ...", f"required; {key.doc}" if key.doc else "required", commented)
    if key.default is OMIT:
        return _line(indent, f"{name}:", key.doc, True)
    return _line(indent, f"{name}: {_flow(key.default)}", key.doc, commented)


def _item_lines(item: Section, entry: dict[str, Any], indent: str, commented: bool) -> list[str]:
    lines: list[str] = []
    first = True
    for name, key in item.keys.items():
        prefix = "- " if first else "  "
        first = False
        if name in entry:
            value = entry[name]
            lines += _line(indent, prefix + f"{name}: {_flow(value)}", key.doc, commented)
        else:
            shown = "..." if key.default in (REQUIRED, OMIT) else _flow(key.default)
            lines += _line(indent, prefix + f"{name}: {shown}", key.doc, True)
    return lines


def reference() -> str:
    lines = _notes("", HEADER)
    for name, key in SCHEMA.keys.items():
        lines.append("")
        lines += _notes("", key.note)
        lines += _key_lines(name, key, "", not key.embedded)
    return "\n".join(lines) + "\n"


def _table_rows(section: Section, path: str) -> list[str]:
    rows: list[str] = []
    for name, key in section.keys.items():
        where = f"{path}.{name}" if path else name
        t = key.type
        inner = t.item if isinstance(t, ListOf) else t.value if isinstance(t, MapOf) else t
        if isinstance(inner, Section):
            if inner is not t:
                where += "[]" if isinstance(t, ListOf) else ".<name>"
            rows += _table_rows(inner, where)
            continue
        if key.default is REQUIRED:
            shown = "required"
        elif key.default is OMIT:
            shown = "off"
        else:
            shown = f"`{_flow(key.default)}`"
        if key.default_from:
            shown = f"`{key.default_from}`"
        doc, takes = key.doc.replace("|", r"\|"), t.what().replace("|", r"\|")
        rows.append(f"| `{where}` | {takes} | {shown} | {doc} |")
    return rows


def markdown_table() -> str:
    """Every key as a row: its path, what it takes, its default, its doc."""
    head = ["| key | takes | default | what it does |", "|---|---|---|---|"]
    return "\n".join(head + _table_rows(SCHEMA, "")) + "\n"
