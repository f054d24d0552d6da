"""API-key authentication of the HTTP front door (``Authorization: Bearer <key>``), off by default.

Every route except ``GET /health`` needs the key when one is configured; a missing or wrong key gets
401 with an OpenAI error body (code ``invalid_api_key``), before the body is read. The comparison
takes constant time.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.frontend.errors import APIError, error_response

PUBLIC_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    """ASGI middleware requiring ``Authorization: Bearer <api_key>`` outside ``public_paths``."""

    def __init__(self, app: ASGIApp, api_key: str, public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._public = public_paths

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError("Incorrect or missing API key (send Authorization: Bearer <key>).", status=401, code="invalid_api_key")
        response = error_response(err)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
