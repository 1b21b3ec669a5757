"""Limits on the server's connections that uvicorn does not have: a deadline for a request's headers
and a cap on open connections.

uvicorn closes a keep-alive connection idle between requests (``timeout_keep_alive``), but a client
that opens a connection and sends its headers a byte at a time holds it for ever, and nothing caps
how many connections are open: ~20,000 such connections took all but a few of the process's file
descriptors in an audit, after which no tenant could connect. So, per connection:

- **header deadline**: from the connection's first moment, and again from the first byte of each
  later request on it, the request line and headers must be complete within ``header_timeout_s``,
  or the connection is closed (no response: the client has not finished asking). A body and a
  streamed response are not limited by it (the body limit and the request's own cost are).
- **connection cap**: a connection accepted while ``max_connections`` are already open is closed at
  once, before it is read: the file descriptors a server can hold stay bounded, and the connections
  already open (tenants' streams in flight) are never the ones dropped.

``protocol_class(header_timeout_s, max_connections)`` is the ``http`` class given to
``uvicorn.Config``: uvicorn's own httptools protocol with these two checks.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("prefixgate.gateway")


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and a connection cap (the class attributes,
    set by ``protocol_class``)."""

    header_timeout_s: float = 10.0
    max_connections: int = 4096

    _header_timer: asyncio.TimerHandle | None = None
    refused_connections = 0  # connections closed by the cap, over the process (read by tests and logs)
    expired_headers = 0  # connections closed by the header deadline

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            type(self).refused_connections += 1
            if type(self).refused_connections in (1, 100, 10_000):  # a flood logs a few lines, not one each
                log.warning("connection refused: %d connections are open (max_connections); %d refused so far",
                            len(self.connections), type(self).refused_connections)
            transport.close()
            return
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()  # a later request on a kept-alive connection gets its own deadline

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        if self in self.connections:  # a connection the cap refused never joined
            super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        type(self).expired_headers += 1
        self.transport.close()


def protocol_class(header_timeout_s: float, max_connections: int) -> type[LimitedHttpProtocol]:
    """A ``LimitedHttpProtocol`` subclass with these limits (uvicorn instantiates the class itself)."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})
