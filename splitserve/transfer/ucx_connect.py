"""The ucxx connection handshake, done safely when the peer hangs (both sides).

After UCX connected, ucxx (0.52) exchanges a 16-byte "peer info" message (a tag and its hash) between
the connecting side and the listener: each posts a stream receive into a local ``bytearray`` and waits
``connect_timeout``. When that times out (the peer is hung: SIGSTOP, a stalled or hostile process) or is
cancelled, ucxx returns *with the receive still posted* and drops the buffer and the endpoint; once the
peer answers, UCX writes into freed memory (a heap corruption that crashed a prefill worker a moment
later, after its store read from a hung storage node had timed out).

:func:`create_endpoint` (connecting side) and :func:`accept_endpoint` (listener side) do the same
exchange, wire compatible with ucxx, but on any failure, timeout or cancellation first close the
endpoint -- UCX cancels what is posted on a connected endpoint and returns when done -- and keep the
buffers of any request UCX still reports in progress (an endpoint that never connected, e.g. a dead
port) instead of freeing them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import struct

logger = logging.getLogger("splitserve.transfer.ucx")

_PEER_INFO = struct.Struct("QQ")  # (message tag, hash64bits(message tag)), as ucxx's exchange_peer_info
_CLOSE_PERIOD_NS = 2 * 10**9
_SETTLE_S = 0.2  # how long a failed handshake waits for its cancelled requests to complete
_orphans: list = []  # (peer, requests, buffers) still in progress after their endpoint was closed: never freed


async def resolve(host: str, port: int) -> str:
    """An IP address for ``host`` (UCX connects to addresses, not names)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return infos[0][4][0]


async def create_endpoint(host: str, port: int, timeout_s: float):
    """A connected ``ucxx`` Endpoint with error handling on. Raises ``TimeoutError`` when the peer does not
    complete the handshake within ``timeout_s``, ``ConnectionError`` or a UCX error when it fails; either
    way nothing stays posted. UCX must be initialised (``ucx_runtime.acquire``) on the running loop."""
    import ucxx._lib.libucxx as ucx_api  # lazy: importing ucxx loads UCX
    from ucxx import core

    deadline = asyncio.get_running_loop().time() + timeout_s
    ip = await resolve(host, port)
    ctx = core._get_ctx()  # what ucxx.create_endpoint uses
    ctx.continuous_ucx_progress()
    uep = ucx_api.UCXEndpoint.create(ctx.worker, ip, port, True)
    return await _handshake(ctx, uep, f"{ip}:{port}", deadline, listener=False)


async def accept_endpoint(uep, timeout_s: float):
    """The ``ucxx`` Endpoint of a connection request a listener delivered (``uep``, a ``UCXEndpoint``), after
    the handshake with the connecting side; raises like :func:`create_endpoint`."""
    from ucxx import core

    deadline = asyncio.get_running_loop().time() + timeout_s
    return await _handshake(core._get_ctx(), uep, f"client {uep.handle:#x}", deadline, listener=True)


async def _handshake(ctx, uep, peer: str, deadline: float, *, listener: bool):
    from ucxx._lib.arr import Array
    from ucxx._lib_async.endpoint import Endpoint
    from ucxx._lib_async.utils import hash64bits

    loop = asyncio.get_running_loop()
    my_tag = hash64bits("msg_tag", os.urandom(16), uep.handle)
    mine = bytearray(_PEER_INFO.pack(my_tag, hash64bits(my_tag)))
    theirs = bytearray(_PEER_INFO.size)
    buffers = (mine, theirs, Array(mine), Array(theirs))
    send, recv = (uep.stream_send, buffers[2]), (uep.stream_recv, buffers[3])
    requests: list = []
    try:
        for post, arr in ((send, recv) if listener else (recv, send)):  # ucxx's order on each side
            ctx.worker.populate_python_futures_pool()
            req = post(arr)
            requests.append(req)
            if req.future is None:  # pragma: no cover - ucx_runtime always enables Python futures
                raise RuntimeError("ucxx must run with Python futures (splitserve.transfer.ucx_runtime.acquire)")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"UCX handshake with {peer} timed out")
            try:
                await asyncio.wait_for(asyncio.shield(req.future), remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(f"UCX handshake with {peer} timed out") from None
            req.check_error()
        peer_tag, checksum = _PEER_INFO.unpack(theirs)
        if checksum != hash64bits(peer_tag):
            raise ConnectionError(f"UCX handshake with {peer}: bad peer info")
    except BaseException:
        await _discard(peer, uep, requests, buffers)
        raise
    return Endpoint(endpoint=uep, ctx=ctx, tags={"msg_send": peer_tag, "msg_recv": my_tag})


async def _discard(peer: str, uep, requests: list, buffers) -> None:
    """Close ``uep`` and make sure UCX can no longer write into ``buffers``; never raises.

    Closing cancels what is posted on a connected endpoint (the requests then complete at once). On an
    endpoint that never connected (a dead port) UCX leaves the handshake receive "in progress" forever
    although nothing can arrive; after a short wait such requests and their buffers are parked in
    ``_orphans`` (a few hundred bytes each, dropped once UCX reports them complete) instead of freed.
    """
    try:
        uep.close_blocking(period=_CLOSE_PERIOD_NS, max_attempts=1)
        uep.remove_close_callback()
    except Exception:  # pragma: no cover - defensive
        logger.exception("closing a failed UCX endpoint")
    futures = [r.future for r in requests if not r.future.done()]
    if futures:
        try:
            await asyncio.shield(asyncio.wait(futures, timeout=_SETTLE_S))
        except asyncio.CancelledError:
            pass
    for f in futures:
        if f.done() and not f.cancelled():
            f.exception()
    _orphans[:] = [o for o in _orphans if not all(r.completed for r in o[1])]
    if any(not r.completed for r in requests):
        logger.debug("UCX handshake with %s still in progress after closing its endpoint; keeping its buffers", peer)
        _orphans.append((peer, requests, buffers))
