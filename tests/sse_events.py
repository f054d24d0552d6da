"""Read an OpenAI-style server-sent-event stream in tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx


async def sse(http: httpx.AsyncClient, path: str, body: dict) -> AsyncIterator[dict]:
    """The JSON events of a streamed POST, up to ``data: [DONE]``; fails the test on a non-200 status, an error
    event or a stream that ends without ``[DONE]``."""
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return
            event = json.loads(data)
            assert "error" not in event, event
            yield event
    raise AssertionError("stream ended without data: [DONE]")
