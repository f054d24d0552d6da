"""Client side of the store's data plane: read and write byte ranges of storage nodes over UCX.

``read`` posts a receive per range straight into the caller's buffers (e.g. numpy views of KV blocks of
the engine's cache: zero staging copies), then sends the REQUEST; ``write`` sends the REQUEST and every
range straight from the caller's buffers, then waits for the node's STATUS. One cached endpoint per node
(:class:`~splitserve.transfer.ucx_endpoints.EndpointCache`); messages are posted with
:class:`~splitserve.transfer.ucx_requests.Posted`, the layer the KV transfer uses too.

Cancel- and failure-safety: when ``read``/``write`` raises (timeout, refusal, connection error,
``asyncio.CancelledError``) nothing it posted is still posted: whatever is pending is cancelled by
aborting the endpoint, which returns once UCX finished cancelling. So the caller may free or reuse its
buffers at once. Aborting fails other requests in flight on the same endpoint too; they raise
:class:`StoreIOError` and the next request reconnects.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from splitserve.errors import StoreIOError
from splitserve.kvstore import wire
from splitserve.transfer.ucx_endpoints import EndpointCache
from splitserve.transfer.ucx_requests import Posted, connection_tag

#: one range of a request: (offset in the node's segment, the local buffer of exactly that many bytes)
Range = tuple[int, np.ndarray]

#: ranges per UCX request; larger batches go as several requests, one after the other
MAX_RANGES_PER_REQUEST = 64


def _root(buf: np.ndarray) -> np.ndarray:
    while isinstance(buf.base, np.ndarray):
        buf = buf.base
    return buf


def merge_ranges(ranges: list[Range]) -> list[Range]:
    """Merge neighbours that are adjacent both in the segment and in local memory (views of one 1-D uint8
    array, e.g. consecutive KV blocks of an engine's cache) into one range: one UCX message each."""
    runs: list[list] = []  # [offset, nbytes, root or None, start address in root, original buffer]
    for offset, buf in ranges:
        root = _root(buf)
        mergeable = root.ndim == 1 and root.dtype == np.uint8 and root.flags.c_contiguous and buf.flags.c_contiguous
        addr = buf.__array_interface__["data"][0] if mergeable else 0
        if runs and mergeable:
            last = runs[-1]
            if last[2] is root and last[0] + last[1] == offset and last[3] + last[1] == addr:
                last[1] += buf.nbytes
                continue
        runs.append([offset, buf.nbytes, root if mergeable else None, addr, buf])
    out: list[Range] = []
    for offset, nbytes, root, addr, buf in runs:
        if root is not None and nbytes != buf.nbytes:
            start = addr - root.__array_interface__["data"][0]
            buf = root[start : start + nbytes]
        out.append((offset, buf))
    return out


class StoreDataClient:
    """``connect_timeout_s``: a storage node that does not accept a connection within this long counts as
    down (connecting to a dead port does not fail fast; it waits for the timeout)."""

    def __init__(self, connect_timeout_s: float = 1.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._endpoints = EndpointCache("storage node", StoreIOError, connect_timeout_s)
        self._req_ids = itertools.count(1)
        self.bytes_read = 0
        self.bytes_written = 0

    async def start(self) -> None:
        """Initialise UCX for this process (inside the running event loop used for all transfers)."""
        if self._endpoints.closed:
            raise RuntimeError("store data client is closed")
        await self._endpoints.start()

    async def close(self) -> None:
        await self._endpoints.close()

    # ---------------------------------------------------------------- transfers
    async def read(self, endpoint: str, ranges: list[Range], timeout_s: float) -> int:
        """Copy each ``(offset, dst)`` range of the node's segment into ``dst``; returns the bytes moved.
        Raises StoreIOError (refused, unreachable, reset, timeout)."""
        return await self._transfer(wire.Op.READ, endpoint, ranges, timeout_s)

    async def write(self, endpoint: str, ranges: list[Range], timeout_s: float) -> int:
        """Copy each ``(offset, src)`` buffer into the node's segment at ``offset``; returns the bytes
        moved once the node confirmed. Raises StoreIOError."""
        return await self._transfer(wire.Op.WRITE, endpoint, ranges, timeout_s)

    async def _transfer(self, op: wire.Op, endpoint: str, ranges: list[Range], timeout_s: float) -> int:
        if self._endpoints.closed or not self._endpoints.started:
            raise StoreIOError("store data client is not started or closed")
        merged = merge_ranges(ranges)
        deadline = asyncio.get_running_loop().time() + timeout_s
        nbytes = 0
        for i in range(0, len(merged), MAX_RANGES_PER_REQUEST):
            nbytes += await self._request(op, endpoint, merged[i : i + MAX_RANGES_PER_REQUEST], deadline)
        return nbytes

    async def _request(self, op: wire.Op, endpoint: str, ranges: list[Range], deadline: float) -> int:
        ep = await self._endpoints.get(endpoint, deadline)
        req = wire.Request(op, next(self._req_ids), [(offset, buf.nbytes) for offset, buf in ranges])
        status_buf = np.zeros(wire.STATUS_BUF_NBYTES, dtype=np.uint8)
        try:
            posted = Posted(ep)
        except Exception as exc:
            self._endpoints.drop(endpoint, ep)
            raise StoreIOError(f"connection to storage node {endpoint} is closed: {exc!r}") from exc

        def tag(i: int, outgoing: bool) -> int:
            return connection_tag(ep, wire.tag(req.req_id, i), outgoing=outgoing)

        try:
            status = posted.recv(status_buf, tag(0, False))
            if op is wire.Op.READ:  # every receive is posted before the request goes out
                for i, (_o, buf) in enumerate(ranges):
                    posted.recv(buf, tag(1 + i, False))
            posted.am_send(wire.encode_request(req))
            if op is wire.Op.WRITE:
                for i, (_o, buf) in enumerate(ranges):
                    posted.send(buf, tag(1 + i, True))
            await posted.wait(deadline, [status])
            self._raise_failed(posted, endpoint)
            code, detail = wire.decode_status(status_buf)
            if code is not wire.Status.OK:
                raise StoreIOError(f"storage node {endpoint} refused {op.name}: {code.name} {detail}")
            await posted.wait(deadline)
            self._raise_failed(posted, endpoint)
        except BaseException as exc:
            # cancels whatever is still posted (a refused WRITE's sends too) before the caller reuses buffers
            await posted.settle(0.0, lambda: self._endpoints.drop(endpoint, ep))
            if isinstance(exc, (StoreIOError, asyncio.CancelledError)):
                raise
            if isinstance(exc, asyncio.TimeoutError):
                raise StoreIOError(f"storage node {endpoint} timed out") from None
            if isinstance(exc, wire.WireError):
                raise StoreIOError(f"bad answer from storage node {endpoint}: {exc}") from None
            raise StoreIOError(f"store {op.name} at {endpoint} failed: {exc!r}") from exc
        nbytes = sum(buf.nbytes for _o, buf in ranges)
        if op is wire.Op.READ:
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        return nbytes

    @staticmethod
    def _raise_failed(posted: Posted, endpoint: str) -> None:
        error = posted.first_error()
        if error is not None:
            raise StoreIOError(f"storage node {endpoint}: {error!r}")
