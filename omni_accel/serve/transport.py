"""The uvicorn pieces of ``omni-accel serve``: connection guards and the drain on SIGTERM / SIGINT.

Connection guards: uvicorn's h11 protocol with a header timeout and connection caps.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but not the time a client may take to send
a request's header block, and its only connection limit (``limit_concurrency``) is global: a few hundred
connections that trickle header bytes (slowloris) would hold every place and lock every other client out. Here

* a connection must deliver each request's complete header block within ``header_timeout_s`` of connecting, or of
  sending the request's first byte (after that the body-stall timeout of the app's guard takes over); else 408;
* one client address holds at most ``max_per_client`` connections and the server ``max_connections`` in all; a
  connection beyond either is answered 429 / 503 with an OpenAI error body as soon as its header arrives, and closed.

The drain: ``DrainingServer`` (below).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

logger = logging.getLogger("omni_accel.serve")


def guarded_protocol(*, header_timeout_s: float, max_per_client: int, max_connections: int) -> type[H11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these limits (its own per-client table, so two
    servers in one process do not share counts)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_per_client": max_per_client,
        "max_connections": max_connections, "open_by_client": {}})


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0
    max_per_client: int = 64
    max_connections: int = 1024
    open_by_client: dict[str, int] = {}  # replaced per class by guarded_protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._host = self.client[0] if self.client else "?"
        held = self.open_by_client.get(self._host, 0)
        self.open_by_client[self._host] = held + 1
        if held >= self.max_per_client:
            self.app = _refusal(429, "rate_limit_error", "too_many_connections",
                                f"this client already holds {held} connections to the server, the most one client "
                                f"may (--max-connections-per-client {self.max_per_client}); reuse a connection or "
                                "close some")
        elif len(self.connections) > self.max_connections:
            self.app = _refusal(503, "server_error", "too_many_connections",
                                f"the server holds {len(self.connections) - 1} connections, the most it takes "
                                f"(--max-connections {self.max_connections}); retry shortly")
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        left = self.open_by_client.get(self._host, 1) - 1
        if left > 0:
            self.open_by_client[self._host] = left
        else:
            self.open_by_client.pop(self._host, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # h11 leaves IDLE once the whole header block is parsed
            self._disarm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        logger.info("omni_accel.serve: %s sent no complete request header within %g s; closing", self._host,
                    self.header_timeout_s)
        body = json.dumps(error_body(f"the request header was not complete within {self.header_timeout_s:g} s "
                                     "(--header-timeout)", "invalid_request_error", None, "header_timeout")).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def _refusal(status: int, kind: str, code: str, message: str):
    """A tiny ASGI app answering one OpenAI error and closing the connection."""
    body = json.dumps(error_body(message, kind, None, code)).encode()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM / SIGINT drain instead of cutting requests: admission stops (new requests: 503),
    queued requests are answered 503 at once, running ones get ``grace_s`` seconds to finish (then 503), and only
    then does uvicorn shut down -- with exit status 0 (uvicorn would re-raise the signal). A second signal ends the
    grace at once. ``drains`` are the job queues (``drain``, ``wait_idle``, ``abandon_running``)."""

    def __init__(self, config: uvicorn.Config, *, drains: list, grace_s: float):
        super().__init__(config)
        self.drains = drains
        self.grace_s = grace_s
        self.draining = False

    def handle_exit(self, sig, frame) -> None:  # the signal handler, on the main thread: hand the work to a thread
        if self.draining:
            threading.Thread(target=self._abandon, name="omni-accel-serve-drain", daemon=True).start()
            return
        self.draining = True
        logger.warning("omni_accel.serve: signal %d: draining (queued requests answered 503, running ones get %g s)",
                       sig, self.grace_s)
        threading.Thread(target=self._drain, name="omni-accel-serve-drain", daemon=True).start()

    def _drain(self) -> None:
        for queue in self.drains:
            queue.drain()
        deadline = time.monotonic() + self.grace_s
        for queue in self.drains:
            if not queue.wait_idle(max(0.0, deadline - time.monotonic())):
                logger.warning("omni_accel.serve: %d running request(s) did not finish within the grace; answering "
                               "them 503", queue.abandon_running())
        self.should_exit = True

    def _abandon(self) -> None:
        for queue in self.drains:
            queue.drain()
            queue.abandon_running()
        self.should_exit = True
