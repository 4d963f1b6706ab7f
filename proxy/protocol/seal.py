"""Sealed reasoning: the model's reasoning text, encrypted by the proxy, travels in the
reasoning item's `encrypted_content` and comes back on the next turn, so the model sees
its own reasoning across a tool loop and nothing is stored anywhere.

AES-256-GCM with a key id in clear (keys rotate: seal with the active key, open with any
configured one). The associated data binds a ciphertext to the API key it was made for
(the auth record's key_id; "anonymous" without auth), so reasoning sealed for one key does
not open for another, and the sealed payload starts with its issue time, so it expires
after `reasoning_seal.ttl_s`. A ciphertext the proxy cannot open (another provider's, a
rotated-out key, another API key's, tampered) opens to None, an expired one raises
SealExpired; either way the translation drops it with a notice, as a client replaying an
old history must not be locked out of its conversation by a 400.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
import time
from typing import Any

PREFIX = "rp2"  # rp1 tokens carried no binding: they no longer open
ANONYMOUS = "anonymous"  # the binding of requests no auth middleware identified
DEFAULT_TTL_S = 7 * 24 * 3600  # a ciphertext's lifetime (config.yaml reasoning_seal.ttl_s takes it as its default)
_ISSUED = struct.Struct(">Q")  # the payload's first 8 bytes: Unix seconds at sealing


class SealExpired(Exception):
    """Opened, but sealed longer ago than the ttl allows; `notice` says so to the client."""

    def __init__(self, ttl_s: float) -> None:
        self.notice = f"reasoning item dropped: encrypted_content expired (sealed more than {ttl_s:g}s ago)"
        super().__init__(self.notice)


def binding(key: Any) -> str:
    """Whom a request's ciphertexts are bound to: its API key's (a KeyRecord) key_id
    ("static:<name>" for a static key), or ANONYMOUS when no auth phase identified the caller."""
    return key.key_id if key is not None else ANONYMOUS


def _ad(kid: str, bound_to: str) -> bytes:
    return f"{PREFIX}\0{kid}\0{bound_to}".encode()


def _b64d(text: str) -> bytes:
    # Strict: urlsafe_b64decode silently skips characters outside the alphabet, so a token
    # with junk appended would still open; validate=True refuses it.
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Sealer:
    def __init__(self, keys: dict[str, bytes], active: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if active not in keys:
            raise ValueError(f"the active key id {active!r} is not among the keys")
        self._aead = {kid: AESGCM(key) for kid, key in keys.items()}
        self.active = active
        self.ttl_s = ttl_s

    def seal(self, text: str, bound_to: str = ANONYMOUS) -> str:
        nonce = os.urandom(12)
        payload = _ISSUED.pack(int(time.time())) + text.encode()
        sealed = self._aead[self.active].encrypt(nonce, payload, _ad(self.active, bound_to))
        return f"{PREFIX}.{self.active}.{_b64e(nonce + sealed)}"

    def unseal(self, token: str, bound_to: str = ANONYMOUS) -> str | None:
        """The text, or None if this proxy cannot open it for `bound_to`; SealExpired past the ttl."""
        if not isinstance(token, str):
            return None
        parts = token.split(".", 2)
        if len(parts) != 3 or parts[0] != PREFIX or parts[1] not in self._aead:
            return None
        try:
            blob = _b64d(parts[2])
            payload = self._aead[parts[1]].decrypt(blob[:12], blob[12:], _ad(parts[1], bound_to))
            (issued,) = _ISSUED.unpack_from(payload)
            text = payload[_ISSUED.size:].decode()
        except (ValueError, binascii.Error, UnicodeDecodeError, Exception):  # InvalidTag is not a ValueError
            return None
        if time.time() - issued > self.ttl_s:
            raise SealExpired(self.ttl_s)
        return text

    def bound(self, bound_to: str) -> tuple[Any, Any]:
        """(seal, unseal) for one caller: the callables a request's translation and answer use."""
        return (lambda text: self.seal(text, bound_to)), (lambda token: self.unseal(token, bound_to))
