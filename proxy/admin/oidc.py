"""Single sign-on for the console: OpenID Connect, the authorization code flow with PKCE.

  GET <prefix>/login-options   what the login page offers (the button's label, or none)
  GET <prefix>/oidc/login      -> the provider's authorization endpoint, with a fresh state, nonce
                                  and PKCE challenge, kept in a signed short-lived cookie
  GET <prefix>/oidc/callback   the provider sends the browser back with a code: the state checked
                                  against the cookie, the code exchanged (with the PKCE verifier and
                                  the client's secret) for an ID token, whose signature (the
                                  provider's published keys), issuer, audience, expiry and nonce are
                                  checked; then its claims name the person (admin.oidc.name_claim)
                                  and give the role (admin.oidc.roles_claim mapped by admin.oidc.roles:
                                  the widest of its values; none mapped: refused). The console's
                                  session cookie is then the same as an admin key's, marked
                                  single sign-on and carrying its role (proxy.admin.auth).

Admin keys keep working beside it (automation, the CLI). A refusal sends the browser back to the
login page with one line saying why (`?sso_error=`), never a token or a claim's value.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import aiohttp
import jwt
from aiohttp import web

from proxy import state
from proxy.admin.auth import AdminAuth
from proxy.logs import log

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import AdminOidc

FLOW_COOKIE = "rp_admin_sso"
FLOW_TTL_S = 600  # the time a person has at the provider's login page
_FLOW = b"oidc-flow"
_ROLE_ORDER = ("viewer", "team_admin", "admin")  # the widest of several mapped roles wins
_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
_TIMEOUT = aiohttp.ClientTimeout(total=10)
# The authorization endpoint's error codes (OAuth 2.0 4.1.2.1, OpenID Connect Core 3.1.2.6)
_PROVIDER_ERRORS = frozenset({"invalid_request", "unauthorized_client", "access_denied", "unsupported_response_type",
                              "invalid_scope", "server_error", "temporarily_unavailable", "interaction_required",
                              "login_required", "account_selection_required", "consent_required",
                              "invalid_request_uri", "invalid_request_object", "request_not_supported",
                              "request_uri_not_supported", "registration_not_supported"})
_METADATA_TTL_S = 3600


class SignOnRefused(Exception):
    """Why a sign-on was refused, in one line for the person at the login page."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class OidcLogin:
    """The relying party of one console: the provider's metadata and keys (cached), the flows."""

    def __init__(self, section: AdminOidc, auth: AdminAuth, prefix: str) -> None:
        self.section = section
        self.auth = auth
        self.prefix = prefix
        self.issuer = str(section.issuer).rstrip("/")
        self._metadata: dict[str, Any] | None = None
        self._metadata_at = 0.0
        self._keys: jwt.PyJWKSet | None = None

    # ------------------------------------------------------------------ the provider

    async def metadata(self, client: aiohttp.ClientSession) -> dict[str, Any]:
        if self._metadata is None or time.monotonic() - self._metadata_at > _METADATA_TTL_S:
            data = await _get_json(client, self.issuer + "/.well-known/openid-configuration")
            if str(data.get("issuer", "")).rstrip("/") != self.issuer:
                raise SignOnRefused("the provider's metadata names another issuer")
            for field in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
                if not isinstance(data.get(field), str):
                    raise SignOnRefused(f"the provider's metadata has no {field}")
            self._metadata, self._metadata_at, self._keys = data, time.monotonic(), None
        return self._metadata

    async def signing_key(self, client: aiohttp.ClientSession, kid: str | None) -> Any:
        """The provider's key `kid` (its published set fetched again once for a key it did not have)."""
        for fresh in (False, True):
            if self._keys is None or fresh:
                meta = await self.metadata(client)
                self._keys = jwt.PyJWKSet.from_dict(await _get_json(client, meta["jwks_uri"]))
            for key in self._keys.keys:
                if kid is None or key.key_id == kid:
                    return key
        raise SignOnRefused("the ID token is signed with a key the provider does not publish")

    # ------------------------------------------------------------------ the flow

    def redirect_url(self, request: web.Request) -> str:
        configured = self.section.redirect_url
        return configured or f"{request.scheme}://{request.host}{self.prefix}/oidc/callback"

    async def login(self, request: web.Request) -> web.StreamResponse:
        """A redirect to the provider (raised: aiohttp's way to answer with an HTTPFound)."""
        try:
            meta = await self.metadata(request.config_dict[state.SESSION])
        except (SignOnRefused, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise self.refused(f"the single sign-on provider cannot be reached ({_why(exc)})") from None
        verifier = secrets.token_urlsafe(48)
        flow = {"state": secrets.token_urlsafe(24), "nonce": secrets.token_urlsafe(24), "verifier": verifier,
                "exp": time.time() + FLOW_TTL_S}
        query = {"response_type": "code", "client_id": self.section.client_id, "scope": self.section.scopes,
                 "redirect_uri": self.redirect_url(request), "state": flow["state"], "nonce": flow["nonce"],
                 "code_challenge": _b64(hashlib.sha256(verifier.encode()).digest()),
                 "code_challenge_method": "S256"}
        response = web.HTTPFound(meta["authorization_endpoint"] + "?" + urlencode(query))
        payload = _b64(json.dumps(flow, separators=(",", ":")).encode())
        # Lax, not Strict: the provider sends the browser back by a top-level GET from its own site.
        response.set_cookie(FLOW_COOKIE, payload + "." + self.auth.sign(_FLOW, payload.encode()),
                            max_age=FLOW_TTL_S, path=self.prefix + "/oidc", httponly=True, samesite="Lax",
                            secure=self.auth.secure)
        raise response

    def _flow(self, request: web.Request) -> dict[str, Any]:
        cookie = request.cookies.get(FLOW_COOKIE, "")
        payload, _, signature = cookie.partition(".")
        if not payload or not self.auth.signed(_FLOW, payload.encode(), signature):
            raise SignOnRefused("the sign-on was not started here, or took too long; try again")
        flow = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        if flow["exp"] <= time.time():
            raise SignOnRefused("the sign-on took too long; try again")
        if not secrets.compare_digest(str(request.query.get("state", "")), flow["state"]):
            raise SignOnRefused("the provider's answer is not for this sign-on (its state differs)")
        return flow

    async def callback(self, request: web.Request) -> web.StreamResponse:
        try:
            if "error" in request.query:  # shown on the login page: only a code the spec defines, never the text sent
                code = request.query["error"]
                raise SignOnRefused(f"the provider refused ({code if code in _PROVIDER_ERRORS else 'an error'})")
            flow = self._flow(request)
            claims = await self._claims(request, flow)
            name, role = self.person(claims)
            teams = self.teams(claims) if role == "team_admin" else ()
            if role == "team_admin" and not teams:
                raise SignOnRefused(f"a team_admin needs a team ({self.section.teams_claim} names none)")
        except SignOnRefused as exc:
            raise self.refused(str(exc)) from None
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, jwt.PyJWTError) as exc:
            raise self.refused(f"the provider's answer could not be checked ({_why(exc)})") from None
        token, _ = self.auth.issue(name, oidc_role=role, oidc_teams=teams)
        log.info("admin signed on", admin=f"oidc:{name}", role=role, teams=list(teams))
        response = web.HTTPFound(self.prefix + "/")
        self.auth.set_cookie(response, token, self.prefix)
        response.del_cookie(FLOW_COOKIE, path=self.prefix + "/oidc")
        raise response

    async def _claims(self, request: web.Request, flow: dict[str, Any]) -> dict[str, Any]:
        client = request.config_dict[state.SESSION]
        meta = await self.metadata(client)
        form = {"grant_type": "authorization_code", "code": request.query.get("code", ""),
                "redirect_uri": self.redirect_url(request), "code_verifier": flow["verifier"]}
        secret = self.section.client_secret
        headers = {}
        if secret:  # client_secret_basic: each part form-encoded first (RFC 6749 2.3.1)
            headers["Authorization"] = aiohttp.encode_basic_auth(quote(self.section.client_id, safe=""),
                                                                 quote(secret, safe=""))
        else:
            form["client_id"] = self.section.client_id
        async with client.post(meta["token_endpoint"], data=form, headers=headers, timeout=_TIMEOUT) as answer:
            tokens = await answer.json(content_type=None)
            if answer.status != 200 or not isinstance(tokens, dict) or not isinstance(tokens.get("id_token"), str):
                error = tokens.get("error") if isinstance(tokens, dict) else None
                raise SignOnRefused(f"the provider gave no ID token ({str(error or answer.status)[:80]})")
        id_token = tokens["id_token"]
        header = jwt.get_unverified_header(id_token)
        if header.get("alg") not in _ALGORITHMS:
            raise SignOnRefused(f"the ID token's algorithm {str(header.get('alg'))[:20]!r} is not accepted")
        key = await self.signing_key(client, header.get("kid"))
        claims = jwt.decode(id_token, key=key, algorithms=[header["alg"]], audience=self.section.client_id,
                            issuer=meta["issuer"], options={"require": ["exp", "iat", "sub"]}, leeway=30)
        if not secrets.compare_digest(str(claims.get("nonce", "")), flow["nonce"]):
            raise SignOnRefused("the ID token is not for this sign-on (its nonce differs)")
        return claims

    def teams(self, claims: dict[str, Any]) -> tuple[str, ...]:
        """A team_admin's teams: the team ids its teams claim names (admin.oidc.teams_claim)."""
        values = claims.get(self.section.teams_claim)
        values = [values] if isinstance(values, str) else values if isinstance(values, list) else []
        return tuple(sorted({v for v in values if isinstance(v, str) and v.startswith("team_")}))[:64]

    def person(self, claims: dict[str, Any]) -> tuple[str, str]:
        """(who, their role) from the ID token's claims; SignOnRefused when no value maps to a role."""
        name = claims.get(self.section.name_claim) or claims["sub"]
        values = claims.get(self.section.roles_claim)
        values = [values] if isinstance(values, str) else values if isinstance(values, list) else []
        roles = {self.section.roles[v] for v in values if isinstance(v, str) and v in self.section.roles}
        if not roles:  # the person is not named: a refusal goes into a URL and a log line
            raise SignOnRefused(f"this account has no role here (admin.oidc.roles maps none of its "
                                f"{self.section.roles_claim})")
        return str(name)[:200], max(roles, key=_ROLE_ORDER.index)

    def refused(self, why: str) -> web.HTTPFound:
        log.warning("admin sign-on refused", reason=why)
        response = web.HTTPFound(f"{self.prefix}/?sso_error={quote(why[:300])}")
        response.del_cookie(FLOW_COOKIE, path=self.prefix + "/oidc")
        return response

    async def options(self, request: web.Request) -> web.Response:
        return web.json_response({"oidc": {"label": self.section.label, "url": self.prefix + "/oidc/login"}})


async def _get_json(client: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with client.get(url, timeout=_TIMEOUT) as answer:
        if answer.status != 200:
            raise SignOnRefused(f"{url} answered {answer.status}")
        data = await answer.json(content_type=None)
    if not isinstance(data, dict):
        raise SignOnRefused(f"{url} did not answer a JSON object")
    return data


def _why(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:160]


def add_routes(app: web.Application, login: OidcLogin | None, prefix: str) -> None:
    """The login page's options and the flow's two routes; without single sign-on configured, no
    option, and the flow's routes send the browser back to the login page saying so."""
    if login is not None:
        app.router.add_get("/login-options", login.options)
        app.router.add_get("/oidc/login", login.login)
        app.router.add_get("/oidc/callback", login.callback)
        return

    async def no_options(request: web.Request) -> web.Response:
        return web.json_response({"oidc": None})

    async def not_configured(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"{prefix}/?sso_error={quote('single sign-on is not configured (admin.oidc)')}")

    app.router.add_get("/login-options", no_options)
    app.router.add_get("/oidc/login", not_configured)
    app.router.add_get("/oidc/callback", not_configured)
