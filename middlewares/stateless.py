"""Refuse what needs stored state: this proxy stores nothing (004 doc, "Stateless").

`previous_response_id` is refused by default; `previous_response_id: ignore` follows the
000 doc instead and drops it. `store: true` is accepted and nothing is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.policy.rules import apply_stateless, previous_response_mode
from proxy.runtime.reload import RELOADERS
from proxy.state import RequestContext

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.load import Config
    from proxy.config.sections import Stateless


def create(section: Stateless, app: web.Application):
    """The body check the prepare phase applies (before the tool policy and the translation);
    `section` is config.stateless."""
    mode = previous_response_mode(section)
    reloaders = app.get(RELOADERS)
    if reloaders is not None:
        def reload(new: Config) -> Callable[[], None]:
            fresh = previous_response_mode(new.stateless)

            def commit() -> None:
                nonlocal mode
                mode = fresh
            return commit
        reloaders.on("stateless", reload)

    def stateless(ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        return apply_stateless(body, mode)

    return stateless
