"""The rules of config.yaml that one key's type cannot say: names unique in a list, exactly one
of two keys, a secret's shape, one key bounded by another.

`check(data)` runs on the schema-checked configuration at load, so a broken rule stops
start-up like a wrong type does, with a SchemaError naming the key. The helpers the modules
also need at start (a sealing key's bytes, a static key's digest) live here, so the rule and
its reading cannot disagree.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from proxy.config.types import SchemaError
from proxy.policy.rules import CORE_TOOL_TYPES, HOSTED_TOOL_TYPES, REFUSED_TOOL_TYPES
from proxy.protocol.seal import Sealer

if TYPE_CHECKING:
    from proxy.config.sections import ReasoningSeal

HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
TOKEN = re.compile(r"^[\x21-\x7e]+$")  # a bearer token is printable ASCII without spaces
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an RFC 9110 token
_NOT_PRINTABLE = re.compile(r"[^\x20-\x7e]")  # a header value: visible ASCII and spaces only
SEAL_ENV = "RESPONSES_PROXY_SEAL_KEY"  # a sealing key from the environment, key id "env"


def header_safe(value: Any, where: str) -> None:
    """A config value that goes into a request line or header: a CR or LF in it would end the
    line and start a header (or a request) of its own, so it stops start-up instead."""
    if value is None:
        return
    found = _NOT_PRINTABLE.search(str(value))
    if found:
        hint = (" (a key read from a file keeps its trailing newline)"
                if found.group() in "\r\n" and where.endswith("api_key") else "")
        raise SchemaError(f"{where} contains the character {found.group()!r}: only printable ASCII "
                          f"can go into an HTTP header or request line{hint}")


def _workers(workers: list[dict[str, Any]]) -> None:
    names: set[str] = set()
    for i, entry in enumerate(workers):
        if entry["name"] in names:
            raise SchemaError(f"workers[{i}]: duplicate worker name {entry['name']!r}")
        names.add(entry["name"])
        header_safe(entry.get("api_key"), f"workers[{i}].api_key")  # sent as Authorization: Bearer
        header_safe(entry.get("url"), f"workers[{i}].url")  # the request line and Host header


def _outlier(outlier: dict[str, Any]) -> None:
    if outlier["max_ejection_s"] < outlier["base_ejection_s"]:
        raise SchemaError("health.outlier: consecutive_failures >= 1 and 0 <= base_ejection_s <= max_ejection_s")


def key_digest(entry: dict[str, Any], where: str, min_key: int = 1) -> bytes:
    """The sha256 of a configured key ({name, sha256} or {name, key}): what a bearer is matched by."""
    name = entry.get("name")
    if ("sha256" in entry) == ("key" in entry):
        raise SchemaError(f"{where} ({name}) needs exactly one of sha256 or key")
    if "sha256" in entry:
        if not HEX64.match(entry["sha256"]):
            raise SchemaError(f"{where} ({name}): sha256 must be 64 hex digits")
        return bytes.fromhex(entry["sha256"])
    secret = entry["key"]
    # "${ENV}" of an unset variable stops the load; never print the value itself.
    if min_key > 1 and (len(secret) < min_key or not TOKEN.match(secret)):
        raise SchemaError(f"{where} ({name}): key must be at least {min_key} printable characters "
                          "(is its environment variable set?)")
    if not secret:
        raise SchemaError(f"{where} ({name}): key is empty (is its environment variable set?)")
    return hashlib.sha256(secret.encode()).digest()


def _named_keys(entries: Iterable[dict[str, Any]], where: str, what: str, min_key: int = 1) -> None:
    names: set[str] = set()
    for i, entry in enumerate(entries):
        if entry["name"] in names:
            raise SchemaError(f"{where}[{i}]: duplicate {what} name {entry['name']!r}")
        names.add(entry["name"])
        key_digest(entry, f"{where}[{i}]", min_key)


def _admin(admin: dict[str, Any]) -> None:
    oidc = admin.get("oidc") or {}
    if not admin["keys"] and not oidc.get("issuer"):  # no console: nothing else of the section is used
        return
    _named_keys(admin["keys"], "admin.keys", "admin key", min_key=16)
    for i, entry in enumerate(admin["keys"]):
        if (entry.get("role") == "team_admin") != bool(entry.get("teams")):
            raise SchemaError(f"admin.keys[{i}].teams: a team_admin needs its teams (team ids), and only a "
                              "team_admin has teams")
    if oidc.get("issuer"):
        if not oidc.get("client_id"):
            raise SchemaError("admin.oidc.client_id is needed with admin.oidc.issuer")
        issuer = urlsplit(str(oidc["issuer"]))
        if issuer.scheme != "https" and issuer.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SchemaError("admin.oidc.issuer must be https:// (its signing keys are fetched from it; over plain "
                              "http anyone on the path could sign tokens), but on this machine (127.0.0.1)")
        if not oidc.get("roles"):
            raise SchemaError("admin.oidc.roles must map at least one claim value to a role (admin, viewer or "
                              "team_admin): without one nobody could sign in")
    secret = admin.get("session_secret")
    if secret is not None and len(secret) < 16:
        raise SchemaError("admin.session_secret must be at least 16 characters (is its variable set?)")
    prefix = admin_prefix(admin)
    if prefix == "/" or prefix.startswith("/v1"):
        raise SchemaError(f"admin.prefix must be a path of its own (e.g. /admin), not {prefix!r}")


def admin_prefix(admin: Any) -> str:
    """admin.prefix as a path: one leading slash, none trailing."""
    prefix = admin["prefix"] if isinstance(admin, dict) else admin.prefix
    return "/" + str(prefix).strip("/")


def seal_key(kid: str, value: str) -> bytes:
    """A sealing key's 32 bytes (base64 of them, urlsafe or not, padding optional)."""
    if "." in kid:
        raise SchemaError(f"reasoning_seal key id {kid!r} may not contain '.'")
    try:
        raw = base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise SchemaError(f"reasoning_seal.keys.{kid} is not base64") from None
    if len(raw) != 32:
        raise SchemaError(f"reasoning_seal.keys.{kid} must be 32 bytes (base64 of 32 random bytes)")
    return raw


def seal_keys(keys: dict[str, Any] | None, active: str | None) -> tuple[dict[str, bytes], str | None]:
    """The sealing keys (the configured ones, then $RESPONSES_PROXY_SEAL_KEY as "env") and the
    active key id: ({}, None) when there is none."""
    given = {str(k): v for k, v in (keys or {}).items()}
    env = os.environ.get(SEAL_ENV)
    if env and "env" not in given:
        given["env"] = env
    found = {kid: seal_key(kid, str(value)) for kid, value in given.items() if value}
    if not found:
        return {}, None
    chosen = active or next(iter(found))
    if chosen not in found:
        raise SchemaError(f"reasoning_seal.active {chosen!r} is not among the configured keys")
    return found, chosen


def _tools(tools: dict[str, Any]) -> None:
    for name in ("drop", "refuse"):
        core = CORE_TOOL_TYPES.intersection(tools[name] or ())
        if core:
            raise SchemaError(f"tools.{name} cannot name {', '.join(sorted(core))}: those tools are translated")
    drop = HOSTED_TOOL_TYPES if tools["drop"] is None else frozenset(tools["drop"])
    refuse = REFUSED_TOOL_TYPES if tools["refuse"] is None else frozenset(tools["refuse"])
    both = drop & refuse
    if both:
        raise SchemaError(f"tools: {', '.join(sorted(both))} is both dropped and refused")


def _notices(notices: dict[str, Any]) -> None:
    if not HEADER_NAME.match(notices["header"]):
        raise SchemaError(f"notices.header must be a valid HTTP header name, not {notices['header']!r}")


def check(data: dict[str, Any]) -> None:
    """Every rule over the schema-checked configuration (SchemaError naming the key). A policy
    switched off (`enabled: false`) has its own rules skipped: its section is not used."""
    _workers(data["workers"])
    _outlier(data["health"]["outlier"])
    _admin(data["admin"])
    seal = data["reasoning_seal"]
    seal_keys(seal["keys"], seal["active"])
    if data["auth"]["enabled"]:
        _named_keys(data["auth"]["static_keys"], "auth.static_keys", "static key")
    hooks = [hook["name"] for hook in data["alerts"]["webhooks"]]
    for i, name in enumerate(hooks):
        if name in hooks[:i]:
            raise SchemaError(f"alerts.webhooks[{i}]: duplicate webhook name {name!r}")
    if data["tools"]["enabled"]:
        _tools(data["tools"])
    if data["notices"]["enabled"]:
        _notices(data["notices"])


def sealer_from_config(section: ReasoningSeal) -> Sealer | None:
    """config.yaml `reasoning_seal` (config.reasoning_seal) and $RESPONSES_PROXY_SEAL_KEY: the
    sealer, or None without a key. The keys were checked at load by `check`, with this reading."""
    keys, active = seal_keys(section.keys, section.active)
    if not keys:
        return None
    assert active is not None  # seal_keys names the active key whenever there is one
    return Sealer(keys, active, section.ttl_s)
