"""Who may use the admin API: admin keys from config (never client keys), and the
dashboard's session cookie.

  * Each admin key has a role (admin.keys[].role): `admin` may use every route, `viewer` only
    reads (a write, other than logging out, is a 403 `insufficient_role`), whether it comes
    with the key or with a session made by it.
  * `Authorization: Bearer <admin key>`: any admin route its role allows. A client key (ledger or static)
    there is a 403 `client_key_not_allowed`; anything else, or nothing, a 401.
  * The session cookie, set by POST <prefix>/login with an admin key: a signed, expiring
    token `base64(payload).base64(hmac)`, payload {"n": admin name, "e": expiry, "s": a
    random session id}; HttpOnly, SameSite=Strict, Path=<prefix>. Every write (any method
    but GET/HEAD) made with it also needs `X-CSRF-Token`, the HMAC of the session id under
    the same signing key (handed out by login and GET <prefix>/api/session): a page of
    another site can make the browser send the cookie, not read the token. Bearer calls
    need no CSRF token (nothing ambient: the caller sends the key itself). A session write
    whose Origin header names another host is refused too.

Admin keys are kept as sha256 only, compared in constant time against every entry.
The signing key is admin.session_secret when set, else random per process.

Failed admin keys are throttled per client address (`LoginThrottle`): the login form and
a Bearer key on <prefix>/api both spend from the address's budget (admin.login_failures_per_min,
a burst of admin.login_failure_burst); past it every key from that address, the right one
too, is a 429 `too_many_login_attempts` with Retry-After, before the key is compared, so
guessing cannot go on. Successes spend nothing. The address is the connection's peer
(X-Forwarded-For is not read), an IPv6 address by its /64; at most LoginThrottle.MAX_ADDRESSES
addresses are tracked, the least recently failing forgotten first.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import math
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from aiohttp import web

from proxy import state
from proxy.config.cross_checks import key_digest
from proxy.errors import APIError
from proxy.ledger import SECRET_PREFIX
from proxy.ledger.scope import EVERYTHING, Scope

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Admin, AdminKeys

COOKIE = "rp_admin_session"
CSRF_HEADER = "X-CSRF-Token"
_TOKEN = re.compile(r"^[\x21-\x7e]+$")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_OIDC_SESSION = b"\0oidc"  # what a single sign-on session's signature covers besides its payload


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_ADMIN_KEY_REQUIRED = "An admin key is required: 'Authorization: Bearer <admin key>' or a dashboard login."


def unauthorized(message: str = _ADMIN_KEY_REQUIRED) -> APIError:
    return APIError(401, message, code="invalid_admin_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden_client_key() -> APIError:
    return APIError(403, "Client API keys cannot use the admin API; use an admin key.", code="client_key_not_allowed")


def too_many_attempts(retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, f"Too many failed admin logins from this address; retry after {seconds} s.",
                    code="too_many_login_attempts", headers={"Retry-After": str(seconds)})


class LoginThrottle:
    """Failed admin logins per client address: a token bucket of `burst` failures that
    refills at `per_min` a minute. Only failures spend; an address with less than one
    failure left is refused before its key is compared. Memory: at most MAX_ADDRESSES
    buckets (an LRU: the address that failed least recently is forgotten first; a bucket
    that refilled to full is dropped when next seen)."""

    MAX_ADDRESSES = 10_000

    def __init__(self, per_min: float, burst: int, max_addresses: int = MAX_ADDRESSES) -> None:
        self.rate = float(per_min) / 60.0  # failures a second
        self.burst = float(burst)
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    @staticmethod
    def key(address: str | None) -> str:
        """The address a budget belongs to: an IPv6 address by its /64 (one host has them all)."""
        if not address:
            return "?"
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return address  # a unix socket path, or whatever the transport named
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    def _tokens(self, key: str, now: float) -> float:
        entry = self._buckets.get(key)
        if entry is None:
            return self.burst
        tokens, at = entry
        return min(self.burst, tokens + (now - at) * self.rate)

    def retry_after(self, address: str | None, now: float | None = None) -> float:
        """0 when the address may try a key now, else the seconds until it may."""
        now = time.monotonic() if now is None else now
        key = self.key(address)
        tokens = self._tokens(key, now)
        if tokens >= 1.0:
            if tokens >= self.burst:
                self._buckets.pop(key, None)  # refilled: nothing to remember
            return 0.0
        return (1.0 - tokens) / self.rate if self.rate > 0 else 60.0

    def failed(self, address: str | None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        key = self.key(address)
        self._buckets[key] = (max(0.0, self._tokens(key, now) - 1.0), now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)


@dataclass(frozen=True)
class Session:
    name: str
    expires_at: float
    sid: str
    # "key": made by logging in with an admin key (its role read from the configuration at each
    # request); "oidc": by single sign-on (proxy.admin.oidc), its role mapped from the claims at login
    via: str = "key"
    role: str = ""
    teams: tuple[str, ...] = ()  # a team_admin's teams, by single sign-on (a key's: the configuration's)

    @property
    def actor(self) -> str:
        """Who the audit log says acted: admin:<key name>, or oidc:<the person's name claim>."""
        return ("oidc:" if self.via == "oidc" else "admin:") + self.name


class AdminAuth:
    """The admin keys and the session signer of one app."""

    def __init__(self, section: Admin) -> None:
        """config.yaml `admin` (config.admin; its keys and secret checked at load, proxy.config.cross_checks)."""
        self.keys = [(entry.name, key_digest(_given(entry), f"admin.keys[{i}]", 16))
                     for i, entry in enumerate(section.keys)]
        self.roles = {entry.name: entry.role for entry in section.keys}  # admin.keys[].role
        self.teams = {entry.name: frozenset(entry.teams) for entry in section.keys}  # a team_admin's
        self.oidc = bool(section.oidc.issuer)  # single sign-on's sessions are taken only while it is on
        self.prefix = "/admin"  # set by proxy.admin.install
        self.logged_out: dict[str, float] = {}  # session id -> its expiry: refused until then
        self.ttl = section.session_ttl_s
        self.secure = section.cookie_secure
        self.throttle = LoginThrottle(float(section.login_failures_per_min), section.login_failure_burst)
        secret = section.session_secret
        self._signing = hashlib.sha256(b"responses-proxy admin session\0" + (
            secret.encode() if secret else secrets.token_bytes(32))).digest()

    def __repr__(self) -> str:  # never the hashes or the signing key
        return f"AdminAuth(keys={len(self.keys)})"

    # ------------------------------------------------------------------ keys

    def match(self, secret: str) -> str | None:
        """The admin name of a presented key, else None (every entry compared)."""
        digest = hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()
        found = None
        for name, hashed in self.keys:
            if hmac.compare_digest(hashed, digest):
                found = name
        return found

    def authenticate(self, secret: str, address: str | None) -> str | None:
        """match() behind the address's budget of failures: APIError 429 when it is spent
        (the key not even compared), else the admin name, or None (a failure, counted)."""
        wait = self.throttle.retry_after(address)
        if wait > 0:
            raise too_many_attempts(wait)
        name = self.match(secret)
        if name is None:
            self.throttle.failed(address)
        return name

    def role_of(self, session: Session) -> str:
        """A session's role: single sign-on's from its claims at login, a key's from the configuration."""
        return session.role if session.via == "oidc" else self.role(session.name)

    def scope_of(self, name: str, role: str, session: Session | None = None) -> Scope:
        """What an admin may see and change (proxy/ledger/scope.py): a team_admin its teams (a
        key's from the configuration, single sign-on's from the claims at login), else everything."""
        if role != "team_admin":
            return EVERYTHING
        teams = frozenset(session.teams) if session is not None and session.via == "oidc" else self.teams.get(
            name, frozenset())
        return Scope(teams, who=repr(name))

    def role(self, name: str) -> str:
        """The role of the admin key named `name` (a session's too: read from the configuration at
        each request, so a key made a viewer is one on its next request)."""
        return self.roles.get(name, "viewer")

    # ------------------------------------------------------------------ sessions

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._signing, data, hashlib.sha256).digest()

    def sign(self, purpose: bytes, data: bytes) -> str:
        """`data` signed for one purpose (another module's short-lived token: single sign-on's flow)."""
        return _b64(self._mac(purpose + b"\0" + data))

    def signed(self, purpose: bytes, data: bytes, signature: str) -> bool:
        return hmac.compare_digest(signature.encode(), self.sign(purpose, data).encode())

    def _key_of(self, name: str) -> bytes | None:
        return next((hashed for entry, hashed in self.keys if entry == name), None)

    def _session_mac(self, payload: bytes, name: str) -> bytes | None:
        """A session's signature, bound to the admin key it was made with: a new key under the
        same name (the demo admin key, new at every start; a rotated key) ends its sessions."""
        hashed = self._key_of(name)
        return None if hashed is None else self._mac(payload + b"\0key\0" + hashed)

    def issue(self, name: str, now: float | None = None, *, oidc_role: str | None = None,
              oidc_teams: tuple[str, ...] = ()) -> tuple[str, Session]:
        """A session cookie for the admin key `name`, or, with `oidc_role`, for the person `name`
        single sign-on let in with that role (and, a team_admin, those teams; bound to the signing
        key alone: no admin key made it)."""
        expires = (time.time() if now is None else now) + self.ttl
        if oidc_role is not None:
            session = Session(name, expires, secrets.token_urlsafe(16), "oidc", oidc_role, tuple(oidc_teams))
            payload = json.dumps({"n": name, "e": expires, "s": session.sid, "v": "oidc", "r": oidc_role,
                                  "t": list(oidc_teams)}, separators=(",", ":")).encode()
            return f"{_b64(payload)}.{_b64(self._mac(payload + _OIDC_SESSION))}", session
        session = Session(name, expires, secrets.token_urlsafe(16))
        payload = json.dumps({"n": session.name, "e": session.expires_at, "s": session.sid},
                             separators=(",", ":")).encode()
        mac = self._session_mac(payload, name)
        if mac is None:
            raise ValueError(f"no admin key named {name!r}")
        return f"{_b64(payload)}.{_b64(mac)}", session

    def verify(self, token: str | None, now: float | None = None) -> Session | None:
        """The session of a cookie value whose signature holds and which has not expired."""
        if not token or len(token) > 1024 or token.count(".") != 1:
            return None
        body, _, mac = token.partition(".")
        try:
            payload = _unb64(body)
            data = json.loads(payload)
            if data.get("v") == "oidc":
                session = Session(str(data["n"]), float(data["e"]), str(data["s"]), "oidc", str(data["r"]),
                                  tuple(str(t) for t in data.get("t", ())))
                expected: bytes | None = self._mac(payload + _OIDC_SESSION) if self.oidc else None
            else:
                session = Session(str(data["n"]), float(data["e"]), str(data["s"]))
                expected = self._session_mac(payload, session.name)
            if expected is None or not hmac.compare_digest(_unb64(mac), expected):
                return None  # forged, made with a key no longer configured under its name, or SSO turned off
        except (ValueError, KeyError, TypeError):
            return None
        if session.expires_at <= (time.time() if now is None else now):
            return None
        if session.via == "key" and session.name not in {name for name, _ in self.keys}:
            return None  # the admin key was removed from the config since
        if session.sid in self.logged_out:
            return None
        return session

    def log_out(self, session: Session, now: float | None = None) -> None:
        """Refuse this session from now on, in this process (another process of serve
        --workers N still takes it until it expires; the browser drops the cookie anyway)."""
        now = time.time() if now is None else now
        self.logged_out = {sid: exp for sid, exp in self.logged_out.items() if exp > now}  # bounded by the ttl
        self.logged_out[session.sid] = session.expires_at

    def csrf_token(self, session: Session) -> str:
        return _b64(self._mac(b"csrf\0" + session.sid.encode()))

    def csrf_ok(self, session: Session, presented: str | None) -> bool:
        if not presented:
            return False
        return hmac.compare_digest(presented.encode(), self.csrf_token(session).encode())

    def set_cookie(self, response: web.StreamResponse, token: str, prefix: str) -> None:
        response.set_cookie(COOKIE, token, max_age=self.ttl, path=prefix, httponly=True,
                            samesite="Strict", secure=self.secure)

    def clear_cookie(self, response: web.StreamResponse, prefix: str) -> None:
        response.del_cookie(COOKIE, path=prefix)


def _given(entry: AdminKeys) -> dict[str, Any]:
    return {"name": entry.name, **({"sha256": entry.sha256} if entry.sha256 is not None else {"key": entry.key})}


def _same_origin(request: web.Request) -> bool:
    """No Origin header (not a browser, or an old one), or one naming this host: a second
    line behind the CSRF token (the scheme is not compared: TLS may end in front of us)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == (request.host or "").lower()


def bearer(request: web.Request) -> str | None:
    """The bearer token of the request; APIError for a malformed or doubled header."""
    headers = request.headers.getall("Authorization", None)
    if not headers:
        return None
    if len(headers) > 1:
        raise APIError(400, "More than one Authorization header.", code="duplicate_header")
    scheme, _, token = headers[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not _TOKEN.match(token):
        raise unauthorized("Malformed Authorization header: expected 'Authorization: Bearer <admin key>'.")
    return token


# the page, the login (with a key, or by single sign-on and its return), the API description
_OPEN = ("/", "/login", "/login-options", "/oidc/login", "/oidc/callback", "/openapi.json")


async def is_client_key(request: web.Request, token: str) -> bool:
    """A client key: its prefix, or the ledger knows it (revoked or expired too)."""
    if token.startswith(SECRET_PREFIX):
        return True
    ledger = request.config_dict.get(state.LEDGER)
    return ledger is not None and await ledger.lookup_key(token) is not None


# Writes every role may make: ending one's own session.
_ANY_ROLE_WRITES = ("/api/logout",)


def forbidden_role(name: str, role: str) -> APIError:
    what = ("may change its teams' keys and users, nothing else" if role == "team_admin"
            else "may read, not change anything")
    return APIError(403, f"{name!r} is a {role}: it {what}.", code="insufficient_role")


# What a team_admin may write: its teams' keys and users (the service checks which, proxy/ledger/scope.py).
_TEAM_ADMIN_WRITES = ("/api/keys", "/api/users")


def _allowed(role: str, name: str, request: web.Request, rel: str) -> None:
    """A viewer's write (any method but GET/HEAD/OPTIONS) is a 403, before its handler runs; a
    team_admin's, but to keys and users (whose service asks its scope)."""
    if role == "admin" or request.method in SAFE_METHODS or rel in _ANY_ROLE_WRITES:
        return
    if role == "team_admin" and rel.startswith(_TEAM_ADMIN_WRITES):
        return
    raise forbidden_role(name, role)


def guard(auth: AdminAuth, prefix: str):
    @web.middleware
    async def admin_guard(request: web.Request, handler):
        rel = request.path[len(prefix):] or "/"
        if rel in _OPEN or rel.startswith("/static/"):
            return await handler(request)
        token = bearer(request)
        if token is not None:
            name = auth.authenticate(token, request.remote)
            if name is None:
                raise forbidden_client_key() if await is_client_key(request, token) else unauthorized(
                    "Invalid admin key.")
            role = auth.role(name)
            _allowed(role, name, request, rel)
            request[state.ADMIN_ACTOR] = "admin:" + name
            request[state.ADMIN_SCOPE] = auth.scope_of(name, role)
            return await handler(request)
        session = auth.verify(request.cookies.get(COOKIE))
        if session is None:
            raise unauthorized()
        if request.method not in SAFE_METHODS and not (
                auth.csrf_ok(session, request.headers.get(CSRF_HEADER)) and _same_origin(request)):
            raise APIError(403, f"A write with the dashboard session needs the {CSRF_HEADER} header "
                           "and, when the browser sends an Origin, this host's.", code="csrf_failed")
        role = auth.role_of(session)
        _allowed(role, session.name, request, rel)
        request[state.ADMIN_ACTOR] = session.actor
        request[ADMIN_SESSION] = session
        request[state.ADMIN_SCOPE] = auth.scope_of(session.name, role, session)
        return await handler(request)

    return admin_guard


ADMIN = web.AppKey("admin_console", AdminAuth)  # proxy.admin: admin keys, session signer (on the admin sub-app)


ADMIN_SESSION = web.RequestKey("admin_session", Session)  # proxy.admin.auth: the dashboard session, if any
