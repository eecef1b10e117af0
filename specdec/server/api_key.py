"""An API key that requests must carry, as OpenAI's clients send theirs: `Authorization: Bearer KEY` (ASGI).

    app.add_middleware(ApiKeyCheck, key="...")   # added last: checked before the body is read

Every path but /health and /metrics needs it (load balancers' probes and Prometheus scrapes carry no key). A
request without it, or with another key, gets 401 with an OpenAI-style error (code "invalid_api_key") before
anything of it is read or parsed; the key itself never appears in an answer or a log.
"""

from __future__ import annotations

import hmac

from specdec.server.asgi_error import send_error

OPEN_PATHS = frozenset({"/health", "/metrics"})
API_KEY_ENV = "SPECDEC_API_KEY"  # where the server's command line takes the key from when --api-key is not given


def checked_api_key(key: str) -> str:
    """`key`, if a client can send it in a header: non-empty printable ASCII without spaces; else ValueError."""
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise ValueError(f"the API key (--api-key or ${API_KEY_ENV}) must be non-empty printable ASCII without "
                         "spaces, as it travels in an HTTP header")
    return key


class ApiKeyCheck:
    def __init__(self, app, key: str):
        self.app = app
        self.expected = checked_api_key(key).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        sent = next((value for name, value in scope.get("headers") or () if name == b"authorization"), None)
        scheme, _, token = (sent or b"").strip().partition(b" ")
        # the scheme's case is free (RFC 9110); the comparison takes as long whatever the token
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        message = ("this server needs an API key: send 'Authorization: Bearer KEY' (the openai client's api_key)"
                   if sent is None else "the API key sent is not this server's")
        await send_error(send, 401, message, code="invalid_api_key", headers=((b"www-authenticate", b"Bearer"),))
