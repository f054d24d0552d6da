"""vLLM's ``stream_options.continuous_usage_stats``: usage (so far) on every streamed chunk.

Load generators such as guidellm send it; it must be honoured, not rejected or ignored.
"""

from __future__ import annotations

from tests.test_frontend_http import MODEL, make_client, parse_sse, story  # noqa: F401  (fixture)
from splitserve.frontend.testing import ScriptedBackend


async def test_completion_stream_carries_running_usage(tok, story) -> None:  # noqa: F811
    backend = ScriptedBackend(script=[*story, 2])
    req = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with make_client(tok, backend) as c:
        *chunks, last = parse_sse(await c.post("/v1/completions", json=req))
    n_prompt = len(tok.encode("Hello"))
    counts = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == len(story) + 1 and len(set(counts)) > 5
    assert all(ch["usage"]["prompt_tokens"] == n_prompt for ch in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(story) + 1


async def test_chat_stream_carries_running_usage_and_plain_stream_does_not(tok, story) -> None:  # noqa: F811
    backend = ScriptedBackend(script=[*story, 2])
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with make_client(tok, backend) as c:
        *chunks, last = parse_sse(await c.post("/v1/chat/completions", json=req))
        plain = parse_sse(await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True}))
    content = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")]
    assert content and all(ch["usage"]["completion_tokens"] >= 1 for ch in content)
    assert last["usage"]["completion_tokens"] == len(story) + 1
    assert all(ch["usage"] is None for ch in plain)
