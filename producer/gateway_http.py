"""How `genpool gateway` serves HTTP: uvicorn's h11 protocol plus the two timeouts it lacks.

uvicorn (0.55 here) times out a connection only while it idles between requests
(`timeout_keep_alive`); that timer starts after a response, so a connection that opens and
trickles its headers a line at a time is held forever (500 such slowloris connections were held
for the whole 20 s of a test). And a client that stops reading a stream holds its connection and
its worker slot for as long as the job runs: asyncio pauses our writes, and nothing gives up.
`GatewayProtocol` adds, on uvicorn's own protocol (its events and timers, no socket code):
- header_timeout_s: whenever a connection waits for a request head (just opened, or its previous
  response sent), the head must be complete within this long, else the connection is closed;
- send_buffer_bytes: what one connection may hold unsent, in the kernel (SO_SNDBUF, which turns
  off Linux's autotuning: it let a never-read stream take ~2.9 MB before asyncio saw any
  backpressure) and again in asyncio's write buffer (its high-water mark);
- send_timeout_s: a connection whose writes stay paused this long (the peer took nothing while
  both buffers were full) is aborted. The request then sees a disconnect, which cancels its job
  (producer/gateway.py).
idle_timeout_s is uvicorn's timeout_keep_alive; the app uses it between body chunks too
(producer/gateway_io.read_json). docs/operations.md, "The gateway's limits", has the numbers.
`SameOriginOnly` refuses browsers' cross-site requests to a gateway without keys (CSRF).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Optional
from urllib.parse import urlsplit

import h11
import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from .openai_format import APIError

log = logging.getLogger("genpool.gateway")

HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, SEND_TIMEOUT_S = 10.0, 5.0, 30.0
# 128 KiB each (the kernel doubles SO_SNDBUF): ~384 KiB unread per connection at most, and still
# ~2.5 MB/s to a reader 100 ms away; token streams need a few KB/s.
SEND_BUFFER_BYTES = 128 << 10


class GatewayProtocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    send_timeout_s = SEND_TIMEOUT_S
    send_buffer_bytes = SEND_BUFFER_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._send_timer: Optional[asyncio.TimerHandle] = None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        transport.set_write_buffer_limits(high=self.send_buffer_bytes)
        super().connection_made(transport)
        self._watch_head()

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_head()

    def _watch_head(self) -> None:
        """Arm the header timer while h11 waits for a request head; disarm it once one is in
        (their state leaves IDLE) or the connection is closing."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._head_late)
        elif not waiting and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _head_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            # debug, not warning: a flood of these must not become a flood of log lines
            log.debug("%s: no complete request head within %g s; closing", self.client,
                      self.header_timeout_s)
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._reader_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _reader_stalled(self) -> None:
        self._send_timer = None
        log.warning("%s: the client read nothing for %g s; dropping the connection (its job is "
                    "cancelled)", self.client, self.send_timeout_s)
        self.transport.abort()  # close() would wait for the buffer to drain, i.e. forever

    def connection_lost(self, exc: Optional[Exception]) -> None:
        for timer in (self._header_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._send_timer = None
        super().connection_lost(exc)


def server_config(app, host: str = "127.0.0.1", port: int = 8000, *,
                  header_timeout_s: float = HEADER_TIMEOUT_S,
                  idle_timeout_s: float = IDLE_TIMEOUT_S, send_timeout_s: float = SEND_TIMEOUT_S,
                  send_buffer_bytes: int = SEND_BUFFER_BYTES,
                  log_level: str = "info") -> uvicorn.Config:
    """The uvicorn Config `genpool gateway` runs: h11 with GatewayProtocol's timeouts (httptools,
    when installed, is not used: it would bypass them)."""
    for name, value in (("header_timeout_s", header_timeout_s), ("idle_timeout_s", idle_timeout_s),
                        ("send_timeout_s", send_timeout_s),
                        ("send_buffer_bytes", send_buffer_bytes)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    protocol = type("GatewayProtocol", (GatewayProtocol,),
                    {"header_timeout_s": header_timeout_s, "send_timeout_s": send_timeout_s,
                     "send_buffer_bytes": int(send_buffer_bytes)})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=idle_timeout_s)  # type: ignore[arg-type]


class SameOriginOnly:
    """ASGI middleware of a gateway without keys: a request whose `Origin` names another site
    than its `Host` is refused (403) before anything is read. Browsers send Origin on cross-site
    requests, and some of those need no preflight (a form's multipart upload, a fetch() with a
    Blob body and no Content-Type): any page could otherwise make its visitor's browser use the
    gateway. Other clients send no Origin."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            origin, host = headers.get(b"origin"), headers.get(b"host", b"")
            if origin is not None and urlsplit(origin.decode("latin-1")).netloc.lower() \
                    != host.decode("latin-1").lower():
                err = APIError(403, "cross-site requests are refused: the gateway serves no "
                                    "browser page of another origin", "invalid_request_error",
                               code="cross_origin")
                await JSONResponse(err.body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
