"""Configuration: config.yaml deep-merged over the embedded defaults, then checked.

The defaults alone run a working proxy (the built-in simulator as the upstream, the
SQLite ledger, and, with no file at all, a demo key). The merged result is checked against
the settings classes, which are the schema (proxy/config/sections.py), and the rules across
keys (proxy/config/cross_checks.py) before anything starts: an unknown key, a wrong type, a
broken rule or an unset `${NAME}` is a ConfigError naming the key's path. Then it is read once into the typed settings
(proxy/config/settings.py): each subsystem gets its section as a frozen object
(`config.balance`, `config.routing.affinity`); an operator's own middleware gets its
free-form section as written (`config.get(name)`).
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import yaml

from proxy.config import cross_checks, schema, settings
from proxy.config.types import ConfigError, EnvStr

# The embedded configuration: every default of the settings classes (proxy/config/sections.py).
DEFAULTS: dict[str, Any] = schema.defaults()

_ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, dict) and override is None:
        return copy.deepcopy(base)  # `section:` with nothing under it (all commented out): its defaults
    return copy.deepcopy(override)


def _expand_env(value: Any, path: str = "") -> Any:
    """`${NAME}` as a whole string value reads the environment (secrets stay out of the file).

    An unset NAME is an error naming it; the value is kept as an EnvStr so a port or
    a flag written as `${PORT}` is converted by the schema check.
    """
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):
        match = _ENV_REF.match(value)
        if match:
            name = match.group(1)
            found = os.environ.get(name)
            if found is None:
                raise schema.SchemaError(f"${{{name}}} is not set ({path})")
            text = EnvStr(found)
            text.var = name
            return text
    return value


if TYPE_CHECKING:
    # The root's sections are Config's attributes (set by _typed): a type checker reads them off Root.
    from proxy.config.sections import Root as _Typed
else:
    _Typed = object


class Config(_Typed):
    """The checked configuration: `data` as merged (plain values), `settings` typed from it.

    A section's settings are attributes (`config.balance`); `update` is the one way a value
    changes after the load (what serve makes at start: local keys, the demo key switch)."""

    def __init__(self, data: dict[str, Any], path: Path | None = None) -> None:
        self.data = data
        self.path = path
        self._typed(settings.build(data))
        self.local_keys: Any = None  # what serve made at start (proxy/runtime/local_keys.py)
        # What `update` changed since the load (serve's own changes at start), applied again to a
        # reloaded file (proxy/runtime/reload.py).
        self.overrides: dict[str, dict[str, Any]] = {}

    def _typed(self, root: _Typed) -> None:
        # Each section an instance attribute: a request reads config.routing as a plain attribute.
        self.settings: _Typed = root
        for name in root.__dataclass_fields__:
            setattr(self, name, getattr(root, name))

    def update(self, name: str, **values: Any) -> None:
        """Set keys of section `name`, checked as at the load (ConfigError naming the key)."""
        data = {**self.data, name: {**self.data[name], **values}}
        data[name] = schema.SCHEMA.keys[name].type.check(data[name], name)  # SchemaError is a ConfigError
        cross_checks.check(data)
        self.data = data
        self._typed(settings.build(data))
        self.overrides = {**self.overrides, name: {**self.overrides.get(name, {}), **values}}

    def digest(self) -> str:
        """The checked settings' digest (the first 16 hex digits of the sha256 of their sorted
        JSON): two processes serving the same file agree; a comment or key order does not count."""
        return hashlib.sha256(orjson.dumps(self.data, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()[:16]

    def changed_keys(self, other: Config) -> list[str]:
        """The dotted keys whose values differ from `other`'s (a list is one value)."""
        return _changed_keys(self.data, other.data)

    def replace(self, new: Config) -> None:
        """Serve `new`'s settings from now on (a reload): the same object, so every holder of
        it reads the new sections at its next read."""
        self.data, self.overrides = new.data, new.overrides or self.overrides
        self._typed(new.settings)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None) -> Config:
        data: dict[str, Any] = copy.deepcopy(DEFAULTS)
        file_path = Path(path) if path else None
        where = f"{file_path}: " if file_path is not None else ""
        try:
            if file_path is not None:
                try:
                    loaded = yaml.safe_load(file_path.read_text()) or {}
                except (OSError, yaml.YAMLError) as exc:
                    raise ConfigError(f"cannot read {file_path}: {exc}") from exc
                if not isinstance(loaded, dict):
                    raise ConfigError(f"{file_path}: the top level must be a mapping")
                data = _merge(data, _expand_env(loaded))
            else:
                # No file: the embedded defaults run the simulator for a first try, with a demo
                # key. With a file (an operator's), auth.demo_key is false unless written.
                data["auth"]["demo_key"] = True
            if overrides:
                data = _merge(data, _expand_env(overrides))
            data = schema.validate(data)
            cross_checks.check(data)
        except schema.SchemaError as exc:
            raise ConfigError(f"{where}{exc}") from None
        return cls(data, file_path)

    @classmethod
    def from_dict(cls, overrides: dict[str, Any]) -> Config:
        return cls.load(None, overrides)

    def __getitem__(self, name: str) -> Any:
        return self.data[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)


def _changed_keys(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += _changed_keys(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if old == new else [path or "(the whole file)"]


def default_config() -> str | None:
    """The config file when none is named: $RESPONSES_PROXY_CONFIG, else ./config.yaml if
    present, else None (the embedded defaults). `serve` and `keys` both find it so."""
    named = os.environ.get("RESPONSES_PROXY_CONFIG")
    if named:
        return named
    found = Path("config.yaml")
    return str(found) if found.exists() else None
