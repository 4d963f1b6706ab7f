"""The operators' own middlewares named under `middlewares` ("package.module:factory"): the
free-form part of config.yaml. Their names resolve and their factories accept their section
at start, or start-up stops with one line naming the entry.

A custom factory is called as factory(section, app) with its section as written (a plain
mapping: the schema does not know its keys, the factory checks them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from proxy.config.types import ConfigError

if TYPE_CHECKING:  # for annotations only
    from proxy.config.load import Config

Factory = Callable[[dict[str, Any], Any], Any]


def entries(config: Config, point: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, section) of each custom middleware at `point`, in order."""
    found = []
    for item in getattr(config.middlewares, point):
        if isinstance(item, str):
            name, section = item, config.get(item) or {}
        else:
            ((name, section),) = item.items()
            section = section or {}
        if not isinstance(section, dict):
            raise ConfigError(f"middlewares.{point}: the config section of {name!r} must be a mapping")
        found.append((name, section))
    return found


def factory(entry: str) -> Factory:
    """The callable "package.module:factory" names."""
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an operator's module may fail in any way; report it in one line
        raise ConfigError(f"middlewares: cannot import {module_name!r} for {entry!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    found = getattr(module, attr, None)
    if not callable(found):
        raise ConfigError(f"middlewares: {module_name!r} has no callable {attr!r} for {entry!r}")
    return found


def made(name: str, make: Callable[[Any, Any], Any], section: Any, app: Any) -> Any:
    """What a factory returns for its section; its refusal (any exception) a ConfigError naming it."""
    try:
        return make(section, app)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{name!r} rejected its config section: {type(exc).__name__}: {exc}") from exc


def middleware(point: str, name: str, section: dict[str, Any], app: Any) -> Callable[..., Any]:
    """The aiohttp middleware a custom entry's factory makes."""
    found = made(name, factory(name), section, app)
    if not callable(found):
        raise ConfigError(f"middlewares.{point}: the factory of {name!r} did not return a middleware")
    return found
