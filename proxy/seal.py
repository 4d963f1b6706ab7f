"""Sealed reasoning: the model's reasoning text, encrypted by the proxy, travels in the
reasoning item's `encrypted_content` and comes back on the next turn, so the model sees
its own reasoning across a tool loop and nothing is stored anywhere.

AES-256-GCM with a key id in clear (keys rotate: seal with the active key, open with any
configured one). A ciphertext the proxy cannot open (another provider's, a rotated-out
key, tampered) opens to None and the translation drops it with a notice.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Any

from aiohttp import web

from proxy.config import ConfigError

PREFIX = "rp1"


def _b64d(text: str) -> bytes:
    # Strict: urlsafe_b64decode silently skips characters outside the alphabet, so a token
    # with junk appended would still open; validate=True refuses it.
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Sealer:
    def __init__(self, keys: dict[str, bytes], active: str) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if active not in keys:
            raise ConfigError(f"reasoning_seal.active {active!r} is not among the configured keys")
        self._aead = {kid: AESGCM(key) for kid, key in keys.items()}
        self.active = active

    def seal(self, text: str) -> str:
        nonce = os.urandom(12)
        sealed = self._aead[self.active].encrypt(nonce, text.encode(), self.active.encode())
        return f"{PREFIX}.{self.active}.{_b64e(nonce + sealed)}"

    def unseal(self, token: str) -> str | None:
        if not isinstance(token, str):
            return None
        parts = token.split(".", 2)
        if len(parts) != 3 or parts[0] != PREFIX or parts[1] not in self._aead:
            return None
        try:
            blob = _b64d(parts[2])
            return self._aead[parts[1]].decrypt(blob[:12], blob[12:], parts[1].encode()).decode()
        except (ValueError, binascii.Error, UnicodeDecodeError, Exception):  # InvalidTag is not a ValueError
            return None


def sealer_from_config(section: dict[str, Any]) -> Sealer | None:
    keys_cfg = dict(section.get("keys") or {})
    env_key = os.environ.get("RESPONSES_PROXY_SEAL_KEY")
    if env_key and "env" not in keys_cfg:
        keys_cfg["env"] = env_key
    keys: dict[str, bytes] = {}
    for kid, value in keys_cfg.items():
        if not value:
            continue
        if "." in str(kid):
            raise ConfigError(f"reasoning_seal key id {kid!r} may not contain '.'")
        try:
            raw = _b64d(str(value))
        except (binascii.Error, ValueError) as exc:
            raise ConfigError(f"reasoning_seal.keys.{kid} is not base64") from exc
        if len(raw) != 32:
            raise ConfigError(f"reasoning_seal.keys.{kid} must be 32 bytes (base64 of 32 random bytes)")
        keys[str(kid)] = raw
    if not keys:
        return None
    active = section.get("active") or next(iter(keys))
    return Sealer(keys, str(active))


def install_sealer(app: web.Application, section: dict[str, Any]) -> None:
    from proxy.request import SEALER

    sealer = sealer_from_config(section)
    if sealer is not None:
        app[SEALER] = sealer
