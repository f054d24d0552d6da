"""HTTP listener hardening: idle, half-sent and slow connections are closed; beyond the cap, a fast 503."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from splitserve.frontend.http_server import HttpLimits, http_server

SHORT = HttpLimits(header_timeout_s=0.4, body_timeout_s=0.4, keepalive_timeout_s=0.4, max_connections=1000)


async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"bytes": len(body)})


async def _health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


APP = Starlette(routes=[Route("/echo", _echo, methods=["POST"]), Route("/health", _health)])


@contextlib.asynccontextmanager
async def serving(limits: HttpLimits):
    server = http_server(APP, "127.0.0.1", 0, limits)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "server did not start"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    """True if the server closes the connection (EOF or reset) within ``within_s``."""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(4096), within_s)
            if not chunk:
                return True
    except asyncio.TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def test_a_connection_that_sends_nothing_is_closed() -> None:
    async with serving(SHORT) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_by_server(reader, 5.0)
        writer.close()


async def test_a_trickled_header_is_cut_at_the_header_deadline_not_extended_by_each_byte() -> None:
    async with serving(SHORT) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        closed = False
        for i in range(len(header)):  # one byte every 20 ms: 4 s in all, 10x the header deadline
            try:
                writer.write(header[i:i + 1])
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            if reader.at_eof():
                closed = True
                break
            await asyncio.sleep(0.02)
        assert closed or await closed_by_server(reader, 1.0)
        writer.close()


async def test_a_body_that_never_completes_is_closed() -> None:
    async with serving(SHORT) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        await writer.drain()
        assert await closed_by_server(reader, 5.0)
        writer.close()


async def test_requests_still_work_and_idle_keepalive_connections_are_closed() -> None:
    async with serving(SHORT) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await closed_by_server(reader, 5.0)  # then idle past the keep-alive timeout
        writer.close()


async def test_health_answers_while_hundreds_of_half_open_connections_are_held() -> None:
    limits = HttpLimits(header_timeout_s=30, body_timeout_s=30, keepalive_timeout_s=30, max_connections=1000)
    async with serving(limits) as port:
        held = []
        for _ in range(200):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /health HTTP/1.1\r\nHo")  # half a header, then nothing
            held.append((r, w))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/health", timeout=5)).text == "ok"
        for _, w in held:
            w.close()


async def test_beyond_the_connection_cap_requests_get_a_fast_503() -> None:
    limits = HttpLimits(header_timeout_s=30, body_timeout_s=30, keepalive_timeout_s=30, max_connections=4)
    async with serving(limits) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            r = await client.get("/health", timeout=5)
        assert r.status_code == 503
        for _, w in held:
            w.close()


def test_settings_come_from_the_environment_and_bad_values_name_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("PD_HTTP_HEADER_TIMEOUT_S", "2.5")
    monkeypatch.setenv("PD_HTTP_MAX_CONNECTIONS", "77")
    limits = HttpLimits.from_env()
    assert limits.header_timeout_s == 2.5 and limits.max_connections == 77 and limits.body_timeout_s == 30.0
    monkeypatch.setenv("PD_HTTP_BODY_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PD_HTTP_BODY_TIMEOUT_S"):
        HttpLimits.from_env()
    monkeypatch.setenv("PD_HTTP_BODY_TIMEOUT_S", "1")
    monkeypatch.setenv("PD_HTTP_MAX_CONNECTIONS", "0")
    with pytest.raises(ValueError, match="PD_HTTP_MAX_CONNECTIONS"):
        HttpLimits.from_env()
