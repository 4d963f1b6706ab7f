"""The operator's console: the admin API, its OpenAPI description and the web dashboard,
on a sub-app mounted under admin.prefix (default /admin) when admin.keys is not empty.

    proxy/admin/auth.py       admin keys, the signed session cookie, CSRF
    proxy/admin/routes.py     /api/keys, /api/usage, /api/audit (over proxy/ledger/service.py)
    proxy/admin/dashboard.py  the page, its static files, login / logout, /api/overview
    proxy/admin/admin_openapi.py    /openapi.json of the admin API
    proxy/admin/static/       the dashboard (HTML, JS, CSS) and Chart.js, vendored from npm
                              (scripts/update_chartjs.sh; version and license in static/VENDOR.md)

Only the page, its static files, /login and /openapi.json answer without an admin key;
everything under /api needs `Authorization: Bearer <admin key>` or a dashboard session
(with X-CSRF-Token on every write). A client key there is a 403, no key a 401
(proxy/admin/auth.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from proxy import state
from proxy.admin.auth import ADMIN, AdminAuth, guard
from proxy.config.cross_checks import admin_prefix
from proxy.runtime.refusals import REFUSALS

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Admin


def console_off_hint(request: web.Request) -> str:
    """For a 404 under admin.prefix when no console is mounted: why, in one sentence."""
    section = request.config_dict[state.CONFIG].admin
    prefix = admin_prefix(section)
    if console_on(section) or not (request.path == prefix or request.path.startswith(prefix + "/")):
        return ""
    return (" The operator's console is off: no admin.keys are configured (README \"Operator's console\"; "
            "make run prints a demo admin key).")


def console_on(section: Admin) -> bool:
    """The console is mounted: admin keys are configured, or single sign-on (config.admin)."""
    return bool(section.keys or section.oidc.issuer)


def install(app: web.Application, section: Admin) -> web.Application | None:
    """Mount the console on `app` when admin keys or single sign-on are configured (config.admin);
    the sub-app, or None."""
    if not console_on(section):
        return None
    prefix = admin_prefix(section)
    from proxy.admin import admin_openapi, dashboard, oidc, routes
    from proxy.admin.oidc import OidcLogin

    auth = AdminAuth(section)
    auth.prefix = prefix
    refusals = app.get(REFUSALS)
    if refusals is not None:  # the console's own requests are not the service's errors
        refusals.ignore_prefix = prefix
    admin = web.Application(middlewares=[guard(auth, prefix)])
    admin[ADMIN] = auth
    routes.add_routes(admin)
    dashboard.add_routes(admin, prefix)
    oidc.add_routes(admin, OidcLogin(section.oidc, auth, prefix) if section.oidc.issuer else None, prefix)
    admin.router.add_get("/openapi.json", admin_openapi.handler)

    async def to_page(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(prefix + "/")  # the page's relative links need the slash

    app.router.add_get(prefix, to_page)  # before the sub-app, which would take the bare prefix too
    app.add_subapp(prefix, admin)
    return admin
