"""Who may use the admin API: admin keys from config (never client keys), and the
dashboard's session cookie.

  * `Authorization: Bearer <admin key>`: any admin route. A client key (ledger or static)
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
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from proxy import state
from proxy.config.load import ConfigError
from proxy.http.errors import APIError
from proxy.ledger import SECRET_PREFIX

COOKIE = "rp_admin_session"
CSRF_HEADER = "X-CSRF-Token"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_TOKEN = re.compile(r"^[\x21-\x7e]+$")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def unauthorized(message: str = "An admin key is required: 'Authorization: Bearer <admin key>' or a dashboard login.") -> APIError:
    return APIError(401, message, code="invalid_admin_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden_client_key() -> APIError:
    return APIError(403, "Client API keys cannot use the admin API; use an admin key.", code="client_key_not_allowed")


@dataclass(frozen=True)
class Session:
    name: str
    expires_at: float
    sid: str


class AdminAuth:
    """The admin keys and the session signer of one app."""

    def __init__(self, section: dict[str, Any]) -> None:
        self.keys = _admin_keys(section.get("keys") or [])
        self.prefix = "/admin"  # set by proxy.admin.install
        self.logged_out: dict[str, float] = {}  # session id -> its expiry: refused until then
        self.ttl = int(section.get("session_ttl_s", 28800))
        self.secure = bool(section.get("cookie_secure", False))
        secret = section.get("session_secret")
        if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
            raise ConfigError("admin.session_secret must be at least 16 characters (is its variable set?)")
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

    # ------------------------------------------------------------------ sessions

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._signing, data, hashlib.sha256).digest()

    def issue(self, name: str, now: float | None = None) -> tuple[str, Session]:
        session = Session(name, (time.time() if now is None else now) + self.ttl, secrets.token_urlsafe(16))
        payload = json.dumps({"n": session.name, "e": session.expires_at, "s": session.sid},
                             separators=(",", ":")).encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}", session

    def verify(self, token: str | None, now: float | None = None) -> Session | None:
        """The session of a cookie value whose signature holds and which has not expired."""
        if not token or len(token) > 1024 or token.count(".") != 1:
            return None
        body, _, mac = token.partition(".")
        try:
            payload = _unb64(body)
            if not hmac.compare_digest(_unb64(mac), self._mac(payload)):
                return None
            data = json.loads(payload)
            session = Session(str(data["n"]), float(data["e"]), str(data["s"]))
        except (ValueError, KeyError, TypeError):
            return None
        if session.expires_at <= (time.time() if now is None else now):
            return None
        if session.name not in {name for name, _ in self.keys}:
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
        return bool(presented) and hmac.compare_digest(presented.encode(), self.csrf_token(session).encode())

    def set_cookie(self, response: web.StreamResponse, token: str, prefix: str) -> None:
        response.set_cookie(COOKIE, token, max_age=self.ttl, path=prefix, httponly=True,
                            samesite="Strict", secure=self.secure)

    def clear_cookie(self, response: web.StreamResponse, prefix: str) -> None:
        response.del_cookie(COOKIE, path=prefix)


def _admin_keys(raw: list[Any]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for i, entry in enumerate(raw):
        where = f"admin.keys[{i}]"
        name = entry.get("name")
        if any(name == seen for seen, _ in out):
            raise ConfigError(f"{where}: duplicate admin key name {name!r}")
        if ("sha256" in entry) == ("key" in entry):
            raise ConfigError(f"{where} ({name}) needs exactly one of sha256 or key")
        if "sha256" in entry:
            digest = entry["sha256"]
            if not isinstance(digest, str) or not _HEX64.match(digest):
                raise ConfigError(f"{where} ({name}): sha256 must be 64 hex digits")
            out.append((name, bytes.fromhex(digest)))
            continue
        secret = entry["key"]
        if not isinstance(secret, str) or len(secret) < 16 or not _TOKEN.match(secret):
            # "${ENV}" of an unset variable expands to None; never print the value itself.
            raise ConfigError(f"{where} ({name}): key must be at least 16 printable characters "
                              "(is its environment variable set?)")
        out.append((name, hashlib.sha256(secret.encode()).digest()))
    return out


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


_OPEN = ("/", "/login", "/openapi.json")  # the page, the login, the API description


async def is_client_key(request: web.Request, token: str) -> bool:
    """A key the public API would take: its prefix, or the ledger knows it."""
    if token.startswith(SECRET_PREFIX):
        return True
    ledger = request.config_dict.get(state.LEDGER)
    return ledger is not None and await ledger.lookup_key(token) is not None


def guard(auth: AdminAuth, prefix: str):
    @web.middleware
    async def admin_guard(request: web.Request, handler):
        rel = request.path[len(prefix):] or "/"
        if rel in _OPEN or rel.startswith("/static/"):
            return await handler(request)
        token = bearer(request)
        if token is not None:
            name = auth.match(token)
            if name is None:
                raise forbidden_client_key() if await is_client_key(request, token) else unauthorized(
                    "Invalid admin key.")
            request[state.ADMIN_ACTOR] = "admin:" + name
            return await handler(request)
        session = auth.verify(request.cookies.get(COOKIE))
        if session is None:
            raise unauthorized()
        if request.method not in SAFE_METHODS and not (
                auth.csrf_ok(session, request.headers.get(CSRF_HEADER)) and _same_origin(request)):
            raise APIError(403, f"A write with the dashboard session needs the {CSRF_HEADER} header "
                           "and, when the browser sends an Origin, this host's.", code="csrf_failed")
        request[state.ADMIN_ACTOR] = "admin:" + session.name
        request[state.ADMIN_SESSION] = session
        return await handler(request)

    return admin_guard
