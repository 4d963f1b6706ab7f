"""Reload: config.yaml read again, checked whole, and what may change live swapped in at once.

SIGHUP (what `systemctl reload` sends; under `serve --workers N` the supervisor forwards it to
every process) and `POST <admin prefix>/api/reload` (admin role) call `reload_app`:

  1. the file is loaded and checked as `responses-proxy config check` does (the schema, the
     cross checks, the app built once with its middlewares, nothing started), with what serve
     changed at start applied again (the demo key switch, the keys it made);
  2. the sections that differ are compared with what can change live: each part that owns a
     section registered a reloader for it (`Reloaders.on`): the worker pool (`workers`), the
     balance's prices (`prices`), the limits' global and per-key concurrency (`limits`), the
     notices header (`notices`), the stateless and tool policies (`stateless`, `tools`). A
     change anywhere else (the listen address, the ledger backend, the admin keys...) refuses the
     reload as a whole, naming the keys: the old configuration stays, and one log line says why;
  3. every reloader prepares its new value (which may fail: then nothing changed), then all are
     committed together, with no await between them: a request sees the old or the new, never
     a mix. A request in flight keeps what it read at its start (its price, its worker).

`/readyz` (its `X-Config-Hash` header) and `GET <admin prefix>/api/config` name the configuration
each process serves: the first 16 hex digits of the sha256 of its checked settings (sorted JSON),
so two processes serving the same file agree, and a comment or the order of keys does not count.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from proxy import state
from proxy.config.load import Config, ConfigError
from proxy.logs import log

_NAMED_KEY = re.compile(r"'([A-Za-z_][\w.\[\]-]*)'")  # the key a ConfigError names first

# A reloader: (the new configuration) -> the commit that installs its part (no I/O, no await).
Reloader = Callable[[Config], Callable[[], None]]


class ReloadRefused(Exception):
    """The file cannot be served (`key`: the first key at fault, when one is named)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class Reloaders:
    """What can change live, by section, and what this process serves now. `check`: builds an
    app from a configuration without starting it (proxy.app.build_app: `config check`'s test)."""

    def __init__(self, config: Config, check: Callable[[Config], Any]) -> None:
        self.check = check
        self.by_section: dict[str, list[Reloader]] = {}
        self.hash = config.digest()
        self.loaded_at = time.time()
        self.counts = {"ok": 0, "refused": 0}
        self.last_error: str | None = None

    def on(self, section: str, reloader: Reloader) -> None:
        self.by_section.setdefault(section, []).append(reloader)

    def view(self) -> dict[str, Any]:
        return {"hash": self.hash, "loaded_at": self.loaded_at, "live_sections": sorted(self.by_section),
                "reloads": dict(self.counts), "last_error": self.last_error}


def load_candidate(current: Config, check: Callable[[Config], Any]) -> Config:
    """The file read again and checked whole, with serve's own changes at start applied again."""
    new = Config.load(current.path, overrides=current.overrides or None)
    new.local_keys = current.local_keys
    check(new)  # the middleware factories check their sections here; nothing starts
    return new


def reload_app(app: web.Application) -> dict[str, Any]:
    """Reload this process's configuration (see the module's docstring). Returns the view of
    what it serves now; raises ReloadRefused (nothing changed) with the reason, logged once."""
    reloaders = app[RELOADERS]
    current = app[state.CONFIG]
    try:
        new = load_candidate(current, reloaders.check)
        changed = current.changed_keys(new)
        fixed = [key for key in changed if key.split(".", 1)[0] not in reloaders.by_section]
        if fixed:
            raise ReloadRefused(f"{', '.join(fixed[:5])} cannot change while serving: restart for "
                                f"{'it' if len(fixed) == 1 else 'them'} (nothing was reloaded)", fixed[0])
        commits = [reloader(new) for section in sorted({key.split(".", 1)[0] for key in changed})
                   for reloader in reloaders.by_section[section]]
    except ConfigError as exc:
        named = _NAMED_KEY.search(str(exc))
        raise _refused(reloaders, str(exc), named.group(1) if named else None) from None
    except ReloadRefused as exc:
        raise _refused(reloaders, str(exc), exc.key) from None
    for commit in commits:  # no await: a request sees the old or the new
        commit()
    current.replace(new)
    reloaders.hash, reloaders.loaded_at, reloaders.last_error = new.digest(), time.time(), None
    reloaders.counts["ok"] += 1
    log.warning("configuration reloaded", config_hash=reloaders.hash, changed=changed[:20] or None)
    return reloaders.view()


def _refused(reloaders: Reloaders, why: str, key: str | None) -> ReloadRefused:
    """Count and log a refusal (one line, naming the key); the exception to raise."""
    reloaders.counts["refused"] += 1
    reloaders.last_error = why
    log.error("configuration reload refused", reason=why, key=key, config_hash=reloaders.hash)
    return ReloadRefused(why, key)


class ReloadCollector:
    """/metrics: this process's reloads by result, and the configuration it serves."""

    def __init__(self, reloaders: Reloaders) -> None:
        self.reloaders = reloaders

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reloads = CounterMetricFamily("responses_proxy_config_reloads", "Configuration reloads, by result.",
                                      labels=["result"])
        for result, count in sorted(self.reloaders.counts.items()):
            reloads.add_metric([result], count)
        served = GaugeMetricFamily("responses_proxy_config_info", "The configuration served (1), by hash.",
                                   labels=["hash"])
        served.add_metric([self.reloaders.hash], 1)
        yield reloads
        yield served


RELOADERS = web.AppKey("reloaders", Reloaders)  # proxy.runtime.reload: what can change live, the hash served
