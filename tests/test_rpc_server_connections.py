"""gRPC server connections: one server per port (no silent SO_REUSEPORT sharing); half-open sockets are closed."""

from __future__ import annotations

import pytest

from splitserve.rpc.server import BindError, bind, create_server


async def test_a_second_server_on_a_used_grpc_port_fails_to_bind() -> None:
    first, _ = create_server()
    port = bind(first, "127.0.0.1", 0)
    await first.start()
    try:
        second, _ = create_server()
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind(second, "127.0.0.1", port)
    finally:
        await first.stop(None)


async def test_a_port_is_free_again_after_its_server_stops() -> None:
    first, _ = create_server()
    port = bind(first, "127.0.0.1", 0)
    await first.start()
    await first.stop(None)
    again, _ = create_server()
    assert bind(again, "127.0.0.1", port) == port
    await again.start()
    await again.stop(None)


async def test_a_socket_that_never_speaks_http2_is_closed(monkeypatch) -> None:
    """Half-open and idle TCP connections to a gRPC port do not stay open (gRPC's handshake timeout)."""
    import asyncio

    from splitserve.rpc import server as rpc_server

    monkeypatch.setattr(rpc_server, "HANDSHAKE_TIMEOUT_S", 0.5)
    srv, _ = create_server()
    port = bind(srv, "127.0.0.1", 0)
    await srv.start()
    try:
        silent = await asyncio.open_connection("127.0.0.1", port)
        half = await asyncio.open_connection("127.0.0.1", port)
        half[1].write(b"PRI * HTTP/2.0\r\n")  # half the client preface, then nothing
        for reader, writer in (silent, half):
            try:
                while await asyncio.wait_for(reader.read(1024), 10):
                    pass  # the server's SETTINGS frame, then EOF
            except ConnectionResetError:
                pass
            writer.close()
    finally:
        await srv.stop(None)
