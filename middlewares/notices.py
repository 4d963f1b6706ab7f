"""The request's notices in one response header (004 doc: x-token-notice).

    notices:
      header: x-token-notice
      max_bytes: 2048

Every phase and the translation append human-readable notices to the request context's
`notices` ("tools left out: web_search", "max_output_tokens lowered to 123 to fit the
balance"). They are joined with "; " into one header, set from `app.on_response_prepare`:
that runs when the headers go out, so a streamed response (prepared before its body) and an
error envelope from any phase carry them too. Having nothing to do per request, this policy
is no phase: `create` installs the hook and returns None.

The value is made safe for a header: CR and LF are dropped, every other control or
non-ASCII character becomes "?", and the value is cut at max_bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from proxy.runtime.reload import RELOADERS, ReloadRefused
from proxy.state import CONTEXT, NOTICES_HEADER

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.load import Config
    from proxy.config.sections import Notices

_SEPARATOR = "; "
_ELLIPSIS = "..."


def sanitize(text: str, max_bytes: int) -> str:
    """Printable ASCII only: CR/LF dropped, other controls and non-ASCII -> "?", capped."""
    out = []
    for ch in text:
        if ch in "\r\n":
            continue
        code = ord(ch)
        out.append(ch if 0x20 <= code < 0x7F else "?")
    value = "".join(out).strip()
    if len(value) > max_bytes:  # ASCII now, so characters are bytes
        value = value[: max_bytes - len(_ELLIPSIS)].rstrip() + _ELLIPSIS
    return value


def header_value(notices: list[str], max_bytes: int) -> str:
    unique = list(dict.fromkeys(n for n in notices if isinstance(n, str) and n.strip()))
    return sanitize(_SEPARATOR.join(unique), max_bytes)


def create(section: Notices, app: web.Application):
    """config.yaml `notices` (config.notices)."""
    header, max_bytes = section.header, section.max_bytes
    if app.get(NOTICES_HEADER) is not None:
        raise RuntimeError("notices: installed twice on one app")
    app[NOTICES_HEADER] = header

    reloaders = app.get(RELOADERS)
    if reloaders is not None:
        def reload(new: Config) -> Callable[[], None]:
            if new.notices.header != header:
                raise ReloadRefused("notices.header cannot change while serving: restart for it", "notices.header")

            def commit() -> None:
                nonlocal max_bytes
                max_bytes = new.notices.max_bytes
            return commit
        reloaders.on("notices", reload)

    async def set_header(request: web.Request, response: web.StreamResponse) -> None:
        ctx = request.get(CONTEXT)
        found = ctx.notices if ctx is not None else None
        if not found:
            return
        value = header_value(found, max_bytes)
        if value:
            response.headers[header] = value

    app.on_response_prepare.append(set_header)
    return None
