"""One gRPC server per port: grpcio's default SO_REUSEPORT would let a second server share it silently."""

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
