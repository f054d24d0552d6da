"""Client side of the store's data plane: read and write byte ranges of storage nodes over UCX.

``read`` posts a receive per range straight into the caller's buffers (e.g. numpy views of KV blocks of
the engine's cache: zero staging copies), then sends the REQUEST; ``write`` sends the REQUEST and every
range straight from the caller's buffers, then waits for the node's STATUS. One cached endpoint per node.

Cancel- and failure-safety: when ``read``/``write`` raises (timeout, refusal, connection error,
``asyncio.CancelledError``) nothing it posted is still posted: the endpoint is aborted first, which
cancels its receives and sends and returns once UCX finished cancelling. So the caller may free or
reuse its buffers at once. Aborting fails other requests in flight on the same endpoint too; they raise
:class:`StoreIOError` and the next request reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import numpy as np

from splitserve.errors import StoreIOError
from splitserve.kvstore import wire
from splitserve.kvstore.ucx_common import abort_endpoint, consume
from splitserve.transfer import ucx_runtime
from splitserve.transfer.common import parse_endpoint
from splitserve.transfer.ucx_connect import create_endpoint

logger = logging.getLogger("splitserve.kvstore.client")

#: one range of a request: (offset in the node's segment, the local buffer of exactly that many bytes)
Range = tuple[int, np.ndarray]

#: ranges per UCX request; larger batches go as several requests, one after the other (each posted message
#: takes a ucxx future from a pool that the notifier thread refills)
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
        self._peers: dict[str, object] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._req_ids = itertools.count(1)
        self._acquired = False
        self._closed = False
        self.bytes_read = 0
        self.bytes_written = 0

    async def start(self) -> None:
        """Initialise UCX for this process (inside the running event loop used for all transfers)."""
        if self._acquired:
            return
        if self._closed:
            raise RuntimeError("store data client is closed")
        ucx_runtime.acquire()
        self._acquired = True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in list(self._connecting.values()):
            t.cancel()
        for ep in list(self._peers.values()):
            abort_endpoint(ep)
        self._peers.clear()
        if self._connecting:
            await asyncio.wait(list(self._connecting.values()), timeout=1.0)
        if self._acquired:
            self._acquired = False
            ucx_runtime.release()

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
        if self._closed or not self._acquired:
            raise StoreIOError("store data client is not started or closed")
        merged = merge_ranges(ranges)
        deadline = asyncio.get_running_loop().time() + timeout_s
        nbytes = 0
        for i in range(0, len(merged), MAX_RANGES_PER_REQUEST):
            nbytes += await self._request(op, endpoint, merged[i : i + MAX_RANGES_PER_REQUEST], deadline)
        return nbytes

    async def _request(self, op: wire.Op, endpoint: str, ranges: list[Range], deadline: float) -> int:
        loop = asyncio.get_running_loop()
        ep = await self._endpoint(endpoint, deadline)
        req = wire.Request(op, next(self._req_ids), [(offset, buf.nbytes) for offset, buf in ranges])
        status_buf = np.zeros(wire.STATUS_BUF_NBYTES, dtype=np.uint8)
        status = loop.create_task(ep.recv(status_buf, tag=wire.tag(req.req_id, 0)))
        data = []
        if op is wire.Op.READ:  # post every receive before the request goes out
            data = [loop.create_task(ep.recv(buf, tag=wire.tag(req.req_id, 1 + i))) for i, (_o, buf) in enumerate(ranges)]
        tasks = [status, *data]
        try:
            await asyncio.sleep(0)  # let the receive tasks post
            tasks.append(loop.create_task(ep.am_send(wire.encode_request(req))))
            if op is wire.Op.WRITE:
                data = [loop.create_task(ep.send(buf, tag=wire.tag(req.req_id, 1 + i))) for i, (_o, buf) in enumerate(ranges)]
                tasks += data
            await self._wait([status], deadline, endpoint)
            code, detail = wire.decode_status(status_buf)
            if code is not wire.Status.OK:
                raise StoreIOError(f"storage node {endpoint} refused {op.name}: {code.name} {detail}")
            await self._wait(tasks, deadline, endpoint)
        except BaseException as exc:
            self._drop(endpoint, ep)  # cancels whatever is still posted before the caller reuses buffers
            if any(not t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=1.0)
            for t in tasks:
                if not t.done():
                    t.cancel()
            if isinstance(exc, (StoreIOError, asyncio.CancelledError)):
                raise
            if isinstance(exc, wire.WireError):
                raise StoreIOError(f"bad answer from storage node {endpoint}: {exc}") from None
            raise StoreIOError(f"store {op.name} at {endpoint} failed: {exc!r}") from exc
        finally:
            consume(tasks)
        nbytes = sum(buf.nbytes for _o, buf in ranges)
        if op is wire.Op.READ:
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        return nbytes

    @staticmethod
    async def _wait(tasks, deadline: float, endpoint: str) -> None:
        """Wait for every task until ``deadline``; raise StoreIOError on timeout or the first failure."""
        loop = asyncio.get_running_loop()
        pending = [t for t in tasks if not t.done()]
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreIOError(f"storage node {endpoint} timed out")
            done, pending_set = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
            pending = list(pending_set)
            for t in done:
                if t.exception() is not None:
                    raise StoreIOError(f"storage node {endpoint}: {t.exception()!r}")
        for t in tasks:
            if t.exception() is not None:
                raise StoreIOError(f"storage node {endpoint}: {t.exception()!r}")

    # ---------------------------------------------------------------- endpoints
    def _drop(self, key: str, ep) -> None:
        if self._peers.get(key) is ep:
            del self._peers[key]
        abort_endpoint(ep)

    async def _endpoint(self, key: str, deadline: float):
        ep = self._peers.get(key)
        if ep is not None and not ep.closed:
            return ep
        if ep is not None:
            self._drop(key, ep)
        loop = asyncio.get_running_loop()
        task = self._connecting.get(key)
        if task is None:
            host, port = parse_endpoint(key)
            timeout = min(max(deadline - loop.time(), 0.1), self.connect_timeout_s)
            task = loop.create_task(self._connect(key, host, port, timeout))
            self._connecting[key] = task

            def _done(t: asyncio.Task, key=key) -> None:
                if self._connecting.get(key) is t:
                    del self._connecting[key]
                if not t.cancelled():
                    t.exception()

            task.add_done_callback(_done)
        try:
            return await asyncio.wait_for(asyncio.shield(task), min(max(deadline - loop.time(), 0.0), self.connect_timeout_s + 0.5))
        except (asyncio.TimeoutError, TimeoutError):
            raise StoreIOError(f"timed out connecting to storage node {key}") from None
        except StoreIOError:
            raise
        except Exception as exc:
            raise StoreIOError(f"cannot connect to storage node {key}: {exc!r}") from exc

    async def _connect(self, key: str, host: str, port: int, timeout_s: float):
        ep = await create_endpoint(host, port, timeout_s)
        if self._closed:
            abort_endpoint(ep)
            raise StoreIOError("store data client closed")
        self._peers[key] = ep
        return ep
