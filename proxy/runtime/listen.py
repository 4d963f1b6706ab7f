"""The listening sockets, bound before the app starts (serve and the --workers supervisor)."""

from __future__ import annotations

import socket


def bind_sockets(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """The listening sockets for host:port, bound here so a port in use or a bad host is one
    line (OSError) before anything starts, not a traceback from inside the event loop."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does on Unix
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(1024)  # connections queue from here on, while the app starts
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def listen_error(host: str, port: int, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    return f"cannot listen on {host}:{port}: {reason[:1].lower()}{reason[1:]}"
