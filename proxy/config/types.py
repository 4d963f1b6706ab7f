"""The type system of config.yaml: what the settings classes (proxy/config/sections.py) say of a key.

A `Type` checks one value and names what it expects. A settings class's field says the rest
in its `Annotated` metadata: a `Type` (its bounds: `Int(1, 65535)`; left out, the annotation
gives it: `str` is `Str()`, `tuple[str, ...]` is `ListOf(Str())`), a plain string (its one-line
doc), `COMMENTED` (left out of the embedded configuration, shown commented out in the
reference), `DefaultFrom(path)` and `Note(text)`. proxy/config/schema.py reads each class into
a `Section` of `Key`s, which is itself a `Type`, so sections nest and lists of sections describe
the workers and keys.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

REQUIRED = object()  # a key every entry must set (workers[i].name)
OMIT = object()  # no default to show: absent means "off" to the code that reads it


class ConfigError(Exception):
    """A configuration that cannot run; start-up prints it as one line and exits."""


class SchemaError(ConfigError):
    """One configuration mistake; the message names the key's path."""


class EnvStr(str):
    """A string read from `${NAME}`: may stand for a number or a boolean (ports, flags)."""

    var: str = ""


def _show(value: Any) -> str:
    if isinstance(value, EnvStr):
        return f"{str(value)!r} (from ${{{value.var}}})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def plain_data(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    return str(value) if isinstance(value, EnvStr) else value


# ----------------------------------------------------------------------------- types


class Type:
    def what(self) -> str:
        raise NotImplementedError

    def check(self, value: Any, path: str) -> Any:
        """The value (numbers from the environment converted), or SchemaError."""
        raise NotImplementedError

    def fail(self, value: Any, path: str) -> SchemaError:
        return SchemaError(f"{path} must be {self.what()}, not {_show(value)}")

    def from_environment(self, value: Any, path: str, convert: Any) -> Any:
        """A value read from `${NAME}` (an EnvStr) converted to a number, else the value as it is."""
        if not isinstance(value, EnvStr):
            return value
        try:
            return convert(value.strip())
        except ValueError:
            raise self.fail(value, path) from None


def _bounds(lo: Any, hi: Any, gt: Any) -> str:
    if gt is not None:
        return f" > {gt}" + (f" and <= {hi}" if hi is not None else "")
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


@dataclass(frozen=True)
class Int(Type):
    lo: int | None = None
    hi: int | None = None

    def what(self) -> str:
        return "an integer" + _bounds(self.lo, self.hi, None)

    def check(self, value: Any, path: str) -> Any:
        value = self.from_environment(value, path, int)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(value, path)
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise self.fail(value, path)
        return value


@dataclass(frozen=True)
class Num(Type):
    lo: float | None = None
    hi: float | None = None
    gt: float | None = None  # strictly above

    def what(self) -> str:
        return "a number" + _bounds(self.lo, self.hi, self.gt)

    def check(self, value: Any, path: str) -> Any:
        value = self.from_environment(value, path, float)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(value, path)
        if ((self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi)
                or (self.gt is not None and value <= self.gt)):
            raise self.fail(value, path)
        return value


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


class Bool(Type):
    def what(self) -> str:
        return "true or false"

    def check(self, value: Any, path: str) -> Any:
        if isinstance(value, EnvStr) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise self.fail(value, path)
        return value


@dataclass(frozen=True)
class Str(Type):
    choices: tuple[str, ...] = ()
    nonempty: bool = False

    def what(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return "a non-empty string" if self.nonempty else "a string"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, str) or (self.nonempty and not value) or (self.choices and value not in self.choices):
            raise self.fail(value, path)
        return str(value)


@dataclass(frozen=True)
class Url(Type):
    """An http:// or https:// URL with a host (a port, if any, a number), or one of `also`."""

    also: tuple[str, ...] = ()
    example: str = "http://10.0.0.5:8000"

    def what(self) -> str:
        alternatives = "".join(f" or {a}" for a in self.also)
        return f"an http:// or https:// URL with a host (e.g. {self.example}){alternatives}"

    def check(self, value: Any, path: str) -> Any:
        if isinstance(value, str) and value in self.also:
            return str(value)
        if not isinstance(value, str):
            raise self.fail(value, path)
        try:
            parts = urlsplit(value.strip())
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError:
            raise self.fail(value, path) from None
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname or value != value.strip():
            raise self.fail(value, path)
        return str(value)


class Micros(Type):
    """A non-negative whole number of micro-units of the account currency (1.0 is 1; 1.5 is refused)."""

    def what(self) -> str:
        return "a non-negative integer number of micro-units"

    def check(self, value: Any, path: str) -> Any:
        value = self.from_environment(value, path, float)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(value, path)
        return value


class AnyValue(Type):
    def what(self) -> str:
        return "any value"

    def check(self, value: Any, path: str) -> Any:
        return plain_data(value)


@dataclass(frozen=True)
class Nullable(Type):
    inner: Type

    def what(self) -> str:
        return self.inner.what() + " or null"

    def check(self, value: Any, path: str) -> Any:
        if value is None:
            return None
        try:
            return self.inner.check(value, path)
        except SchemaError as exc:
            if str(exc).startswith(f"{path} must be "):
                raise self.fail(value, path) from None
            raise


@dataclass(frozen=True)
class Either(Type):
    options: tuple[Type, ...]

    def what(self) -> str:
        return " or ".join(o.what() for o in self.options)

    def check(self, value: Any, path: str) -> Any:
        for option in self.options:
            try:
                return option.check(value, path)
            except SchemaError:
                continue
        raise self.fail(value, path)


@dataclass(frozen=True)
class ListOf(Type):
    item: Type
    min_len: int = 0

    def what(self) -> str:
        what = "a list" if self.min_len == 0 else "a non-empty list"
        return f"{what} of {_plural(self.item)}"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, list) or len(value) < self.min_len:
            raise self.fail(value, path)
        return [self.item.check(v, f"{path}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class MapOf(Type):
    """Free keys (model names, label names, key ids), each value of one type."""

    value: Type

    def what(self) -> str:
        return f"a mapping of names to {_plural(self.value)}"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise self.fail(value, path)
        return {k: self.value.check(v, f"{path}.{k}") for k, v in value.items()}


def _plural(t: Type) -> str:
    plural = getattr(t, "plural", None)
    if plural:
        return plural
    if isinstance(t, Section):
        return "mappings"
    if isinstance(t, Str):
        return "strings" if not t.choices else "names"
    if isinstance(t, (Int, Num)):
        return "numbers"
    return "values"


@dataclass(frozen=True)
class DefaultFrom:
    """Left out, the key takes the value of this other key ("server.max_body_bytes")."""

    path: str


@dataclass(frozen=True)
class Note:
    """Comment lines shown above the key in the reference (config.yaml)."""

    text: str


class _Commented:
    def __repr__(self) -> str:
        return "COMMENTED"


# Left out of the embedded configuration and shown commented out in the reference: its default is
# in force all the same (or, with a default of None and a type that is not Nullable, absent means off).
COMMENTED = _Commented()


@dataclass(frozen=True)
class Key:
    type: Type
    default: Any
    doc: str
    embedded: bool = True  # False: left out of the embedded configuration, shown commented out (Opt)
    note: str = ""  # comment lines shown above the key in the reference
    default_from: str = ""  # left out: the value of this other key ("server.max_body_bytes")


@dataclass(frozen=True, eq=False)
class Section(Type):
    """A settings class read as a mapping of keys (proxy/config/schema.py `section_of`)."""

    keys: dict[str, Key] = field(default_factory=dict)
    cls: Any = None  # the settings class it is read from: what proxy/config/settings.py builds

    def what(self) -> str:
        return "a mapping"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise self.fail(value, path)
        out = {}
        for name, item in value.items():
            key = self.keys.get(name) if isinstance(name, str) else None
            where = f"{path}.{name}" if path else str(name)
            if key is None:
                raise SchemaError(unknown_key(where, str(name), self.keys))
            out[name] = key.type.check(item, where)
        for name, key in self.keys.items():
            if key.default is REQUIRED and name not in value:
                raise SchemaError(f"{path} needs {name!r}")
        return out

    def defaults(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, key in self.keys.items():
            if not key.embedded or key.default is REQUIRED or key.default is OMIT:
                continue
            out[name] = key.type.defaults() if isinstance(key.type, Section) and key.default is None else key.default
        return out


def unknown_key(path: str, name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    parent = path[: len(path) - len(name)]
    if close:
        return f"unknown key {path!r} (did you mean {parent + close[0]!r}?)"
    return f"unknown key {path!r} (known here: {', '.join(known)})"
