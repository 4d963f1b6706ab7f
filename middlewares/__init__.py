"""The middleware chain, built once at start-up from config.yaml's `pipeline`.

Each entry is a built-in name (a module of this package with a `create` factory) or a
dotted path `package.module:factory` to an operator's own module. A factory is called as
`factory(section, app)` with the entry's config section and returns an aiohttp
middleware; it may also register app signals or cleanup contexts. A middleware whose work
is all in such signals may say so with `pass_through = True`: it is checked like any other
but left out of the chain (aiohttp would otherwise call it, for nothing, on every request).
Any broken entry (unknown name, import error, bad section) raises ConfigError here, so the
proxy refuses to start instead of failing at the first request.

Order. `auth`, when listed, always runs first, wherever `pipeline` names it: a request
without a valid key is refused from its headers alone, before any middleware reads,
decompresses or parses its body (the body is never read on that path). The other entries,
built-in or custom, run after it in the order `pipeline` gives. A pipeline without `auth`
(a deployment with no keys at all) stays allowed.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from aiohttp import web

from proxy.config.load import Config, ConfigError

BUILTINS = ("stateless", "auth", "limits", "tools", "balance", "notices")

Factory = Callable[[dict[str, Any], web.Application], Any]


def _resolve(entry: str) -> Factory:
    if entry in BUILTINS:
        module_name, attr = f"middlewares.{entry}", "create"
    elif ":" in entry:
        module_name, _, attr = entry.partition(":")
    else:
        raise ConfigError(f"pipeline: unknown middleware {entry!r} (built-ins: {', '.join(BUILTINS)}; "
                          "custom ones are named 'package.module:factory')")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an operator's module may fail in any way; report it in one line
        raise ConfigError(f"pipeline: cannot import {module_name!r} for {entry!r}: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"pipeline: {module_name!r} has no callable {attr!r} for {entry!r}")
    return factory


def _entries(config: Config) -> list[tuple[str, dict[str, Any]]]:
    pipeline = config.get("pipeline") or []
    if not isinstance(pipeline, list):
        raise ConfigError("pipeline must be a list of middleware names")
    entries = []
    for item in pipeline:
        if isinstance(item, str):
            section = config.get(item) or {}
        elif isinstance(item, dict) and len(item) == 1:
            (item, section), = item.items()
            section = section or {}
        else:
            raise ConfigError(f"pipeline: entry {item!r} must be a name or a one-key mapping name: section")
        if not isinstance(section, dict):
            raise ConfigError(f"pipeline: the config section of {item!r} must be a mapping")
        entries.append((item, section))
    return entries


def build_chain(config: Config, app: web.Application) -> list[Any]:
    # Factories are called in config order (the app signals and cleanup contexts they add
    # keep that order); only the chain itself puts auth first.
    first, chain = [], []
    for name, section in _entries(config):
        factory = _resolve(name)
        try:
            middleware = factory(section, app)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"pipeline: {name!r} rejected its config section: {type(exc).__name__}: {exc}") from exc
        if not callable(middleware):
            raise ConfigError(f"pipeline: the factory of {name!r} did not return a middleware")
        if getattr(middleware, "pass_through", False) is True:
            continue
        (first if name == "auth" else chain).append(middleware)
    return first + chain
