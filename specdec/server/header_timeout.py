"""A time limit on a request's headers, which uvicorn does not have (its keep-alive timeout covers only an
idle connection): a client that opens connections and sends headers a byte at a time would otherwise hold
each of them open for ever.

    config = uvicorn.Config(app, http=header_timeout_protocol(timeout_s=10.0), ...)

The limit runs from a connection's first bytes (or a kept-alive connection's first bytes of its next
request) until the request's headers are complete; past it the client gets a 408 and the connection closes.
It wraps uvicorn's own HTTP protocol (httptools when installed, else h11), whichever `http="auto"` would use.
"""

from __future__ import annotations

import asyncio

DEFAULT_HEADER_TIMEOUT_S = 10.0


def _base_protocol() -> type:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:  # httptools is not installed
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def header_timeout_protocol(timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (`base`, default: what "auto" picks) with a limit on header time."""
    base = base or _base_protocol()
    body = b"the request headers took too long to arrive; send them at once"
    timed_out = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))

    class HeaderTimeout(base):
        _header_timer: asyncio.TimerHandle | None = None

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._between_requests():
                self._header_timer = asyncio.get_running_loop().call_later(timeout_s, self._headers_too_slow)
            super().data_received(data)
            if self._header_timer is not None and not self._between_requests():
                self._stop_header_timer()  # the headers are complete: the request runs

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            """No request is running: headers are still to come (or only part of them has)."""
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.write(timed_out)
                self.transport.close()

    HeaderTimeout.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeout
