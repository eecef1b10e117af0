"""An OpenAI-style JSON error sent straight over ASGI, by the layers that answer before the app sees a request (the
body limit, the API key)."""

from __future__ import annotations

import json

from specdec.server.openai_protocol import error_body


async def send_error(send, status: int, message: str, code: str | None = None, headers: tuple = ()) -> None:
    """`status` with {"error": {...}} and `headers` ((name, value) bytes); the connection closes after it, as the
    request's body may be left unread."""
    body = json.dumps(error_body(message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})
