"""Image URL policy: the model server fetches `input_image` URLs, so the proxy decides which
it may fetch before the request leaves (server-side request forgery guard).

    images:
      allow_hosts: []          # non-empty: only these hosts (exact, or "*.example.com");
                               # a listed host is trusted even if it resolves privately
      allow_private: false     # true: skip the address check (a lab behind a firewall)
      resolve_timeout_s: 2.0   # DNS budget per request; past it the URL is refused

By default a URL is refused (400 `image_url_refused`, param `input`) when
  * its scheme is not http or https (data: URIs are always accepted: nothing is fetched),
  * it carries userinfo (`http://a@b/`), a backslash, whitespace or a control character
    (parsers disagree on those, and the model server's parser is not ours),
  * its host is, or resolves to, an address that is not globally routable: loopback,
    private (RFC 1918, ULA), link-local (cloud metadata 169.254.169.254), shared
    (100.64/10), multicast, reserved, unspecified, IPv4-mapped forms of these,
  * its host does not resolve within the budget.
Resolution uses `loop.getaddrinfo`, so it never blocks the event loop, and every address
a name resolves to must pass (one private A record is enough to refuse).

The check runs once per request in `proxy.http.request.translation`, after the pure translation:
`image_urls(chat)` lists the URLs of the translated body, `check_images` resolves and judges.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from proxy.errors import bad_request


class ImageSettings(Protocol):
    """What the policy reads of config.yaml `images` (proxy.config.sections.Images): the policy
    sits below the configuration."""

    @property
    def allow_hosts(self) -> Sequence[str]: ...

    @property
    def allow_private(self) -> bool: ...

    @property
    def resolve_timeout_s(self) -> float: ...

__all__ = ["ImagePolicy", "image_urls", "check_images", "verdict_for_address"]

_CODE = "image_url_refused"


class ImagePolicy:
    def __init__(self, section: ImageSettings) -> None:
        """config.yaml `images` (config.images)."""
        self.allow_hosts = [h.lower().rstrip(".") for h in section.allow_hosts]
        self.allow_private = section.allow_private
        self.resolve_timeout = section.resolve_timeout_s

    def listed(self, host: str) -> bool:
        for entry in self.allow_hosts:
            if entry.startswith("*."):
                if host.endswith(entry[1:]) and host != entry[2:]:
                    return True
            elif host == entry:
                return True
        return False


def image_urls(chat: dict[str, Any]) -> list[str]:
    """Every image URL in a translated chat-completions body (data URIs included)."""
    found: list[str] = []
    messages = chat.get("messages") if isinstance(chat, dict) else None
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if isinstance(url, str):
                    found.append(url)
    return found


def verdict_for_address(address: str) -> str | None:
    """None when the address is globally routable, else why not."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped or ip.sixtofour
        if mapped is not None:
            ip = mapped
        elif ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64: the embedded IPv4 decides
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    for flag in ("is_loopback", "is_link_local", "is_private", "is_multicast", "is_reserved",
                 "is_unspecified"):
        if getattr(ip, flag):
            return flag[3:].replace("_", "-")
    if not ip.is_global:
        return "not globally routable"
    return None


def _refuse(reason: str) -> Exception:
    return bad_request(f"input_image URL refused: {reason}.", param="input", code=_CODE)


def _host_of(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL after the syntactic checks; raises the 400."""
    if any(ch <= " " or ch == "\x7f" for ch in url) or "\\" in url:
        raise _refuse("the URL contains whitespace, a control character or a backslash")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise _refuse("the URL cannot be parsed") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise _refuse("only http, https and data: URLs are accepted")
    if "@" in parts.netloc:
        raise _refuse("URLs with credentials are not accepted")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise _refuse("the URL has no host")
    return host, port or (443 if parts.scheme.lower() == "https" else 80)


async def _resolve(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]  # type: ignore[misc]  # an inet family's address is a str


async def check_images(policy: ImagePolicy, chat: dict[str, Any]) -> None:
    """Raise the 400 for the first URL the policy refuses; return quietly otherwise."""
    to_resolve: dict[tuple[str, int], str] = {}
    for url in image_urls(chat):
        if url[:5].lower() == "data:":
            continue
        host, port = _host_of(url)
        if policy.allow_hosts:
            if not policy.listed(host):
                raise _refuse(f"the host {host[:128]!r} is not in images.allow_hosts")
            continue
        if policy.allow_private:
            continue
        literal = host[1:-1] if host.startswith("[") else host
        try:
            ipaddress.ip_address(literal.split("%", 1)[0])
        except ValueError:
            to_resolve[(host, port)] = url
            continue
        reason = verdict_for_address(literal)
        if reason is not None:
            raise _refuse(f"the address is {reason}")
    if not to_resolve:
        return
    try:
        async with asyncio.timeout(policy.resolve_timeout):
            results = await asyncio.gather(*(_resolve(h, p) for h, p in to_resolve), return_exceptions=True)
    except TimeoutError:
        raise _refuse("the host did not resolve in time") from None
    for (host, _port), addresses in zip(to_resolve, results):
        if isinstance(addresses, BaseException) or not addresses:
            raise _refuse(f"the host {host[:128]!r} does not resolve")
        for address in addresses:
            reason = verdict_for_address(address)
            if reason is not None:
                raise _refuse(f"the host {host[:128]!r} resolves to an address that is {reason}")
