"""A request body read in full, within a size and a time limit, before the app sees the request (ASGI).

A body over `max_bytes` is refused with 413 as soon as its declared length or its first bytes past the
limit say so (nothing more is read, nothing is parsed); one that has not arrived within `timeout_s` (a
client that sends half a request and stalls) gets 408. Both answers are OpenAI-style JSON errors. The
app then reads the body from memory; later messages (a disconnect) come from the client as usual.
"""

from __future__ import annotations

import asyncio

from specdec.server.asgi_error import send_error

DEFAULT_MAX_BODY_BYTES = 8 << 20  # far above any request a model's context can hold (a 128k-token prompt)
DEFAULT_BODY_TIMEOUT_S = 30.0


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        if max_bytes < 1 or timeout_s <= 0:
            raise ValueError(f"the request body limits must be positive, got {max_bytes} bytes and {timeout_s} s")
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, 413, f"the request body has {int(declared)} bytes; the limit is {self.max_bytes}")
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _TooLarge:
            await send_error(send, 413, f"the request body is over the limit of {self.max_bytes} bytes")
            return
        except asyncio.TimeoutError:
            await send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s")
            return
        except _Disconnected:
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
