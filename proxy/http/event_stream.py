"""Where a Responses event stream goes and how it is encoded, chosen once for every handler
that answers with one (the forwarder, the WebSocket warm-up, the compaction trigger).

An HTTP request gets an SSE response and the SSE encoder. A transport's turn (proxy.http.turn)
gets its TurnStream and the encoder the turn chose (JSON lines, sent as messages as they are):
the rewriter's events reach a socket without being written as SSE and parsed back.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.http.turn import TURN
from proxy.protocol.encoder import SSEEncoder

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class EventStreamResponse(web.StreamResponse):
    # prepare() is always followed at once by the first write (response.created and whatever
    # the first read held): the headers go out with it, one send instead of two (a syscall
    # and a loopback round of TCP work per stream), as aiohttp's own web.Response does.
    # aiohttp has no public switch for this: StreamResponse takes no "send headers with the
    # first write" argument and web.Response buffers the whole body, so the class attribute
    # web.Response itself sets is set here. Should aiohttp rename it, the answer stays right
    # and only the sends double: tests/http/test_forwarder_writes.py pins the sends
    # (test_a_whole_coalesced_answer_is_one_send, ...headers_with_the_first_events...).
    _send_headers_immediately = False


def open_event_stream(request: web.Request) -> tuple[Any, Any]:
    """(the response to prepare and write, the encoder whose bytes it takes) for `request`."""
    turn = request.get(TURN)
    if turn is None:
        return EventStreamResponse(status=200, headers=SSE_HEADERS), SSEEncoder()
    return turn.stream(dict(SSE_HEADERS)), turn.encoder()
