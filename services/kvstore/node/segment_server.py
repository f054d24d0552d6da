"""The storage node's data plane: serves reads and writes of byte ranges of its segment over UCX.

Per request (:mod:`splitserve.kvstore.wire`): the client posts its receives, then sends one REQUEST
active message. READ: the node answers STATUS and, on OK, each range straight from the segment (zero
copies in splitserve: UCX reads the segment memory); on refusal it sends an empty message per range so
the client's posted receives complete without touching its buffers. WRITE: the client sends each range
right after the request; the node posts receives straight into the segment and answers STATUS once all
arrived (or FAILED after ``io_timeout_s``, aborting the connection so nothing arrives later). A refused
WRITE is answered at once; the client then aborts its endpoint, which cancels its sends.

The node knows nothing of objects: the master decides which ranges hold what, and readers verify a
checksum, so a late write into reused space (a reclaimed zombie write) is detected, never served silently.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass

import numpy as np

from splitserve.kvstore import wire
from splitserve.kvstore.ucx_common import abort_endpoint, consume, ucxx
from splitserve.transfer import ucx_runtime
from splitserve.transfer.common import advertise_host, format_endpoint

logger = logging.getLogger("splitserve.kvstore.node")

_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass
class SegmentStats:
    bytes_read: int = 0  # bytes served to readers
    bytes_written: int = 0  # bytes received from writers
    reads: int = 0
    writes: int = 0
    refused: int = 0
    failed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SegmentServer:
    """A ``nbytes`` memory segment behind a ucxx listener. Start and use it on one event loop."""

    def __init__(self, nbytes: int, *, host: str = "127.0.0.1", port: int = 0, io_timeout_s: float = 30.0) -> None:
        if nbytes < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {nbytes}")
        self.nbytes = nbytes
        self.segment = np.empty(nbytes, dtype=np.uint8)
        self.segment.fill(0)  # touch every page now, not during the first transfers
        self._host = advertise_host(host)
        self._port = int(port)
        self._io_timeout_s = float(io_timeout_s)
        self._listener = None
        self._peers: set = set()
        self._tasks: set[asyncio.Task] = set()
        self._acquired = False
        self._closing = False
        self.stats = SegmentStats()

    async def start(self) -> None:
        ucx_runtime.acquire()
        self._acquired = True
        try:
            self._listener = ucxx().create_listener(self._on_connect, port=self._port)
        except Exception:
            self._acquired = False
            ucx_runtime.release()
            raise
        self._port = self._listener.port
        logger.info("segment of %d bytes served over UCX at %s", self.nbytes, self.endpoint)

    @property
    def endpoint(self) -> str:
        return format_endpoint(self._host, self._port)

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        for ep in list(self._peers):
            abort_endpoint(ep)  # cancels posted sends/receives; the tasks then finish
        self._peers.clear()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for _ in range(3):  # ucxx retires finished listener handlers one loop iteration later
            await asyncio.sleep(0)
        self._listener = None
        if self._acquired:
            self._acquired = False
            ucx_runtime.release()

    # ---------------------------------------------------------------- connections
    async def _on_connect(self, ep) -> None:
        if self._closing:
            abort_endpoint(ep)
            return
        me = asyncio.current_task()
        self._tasks.add(me)
        self._peers.add(ep)
        try:
            while not self._closing:
                try:
                    msg = await ep.am_recv()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # peer closed or connection error
                    logger.debug("store connection ended: %s", exc)
                    break
                try:
                    req = wire.decode_request(msg)
                except wire.WireError as exc:
                    logger.warning("malformed store request, dropping the connection: %s", exc)
                    break
                task = asyncio.get_running_loop().create_task(self._serve(ep, req))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(me)
            if ep in self._peers:
                self._peers.discard(ep)
                abort_endpoint(ep)

    async def _serve(self, ep, req: wire.Request) -> None:
        if self._closing:
            status, detail = wire.Status.CLOSING, "storage node is closing"
        else:
            detail = wire.check_ranges(req.ranges, self.nbytes)
            status = wire.Status.INVALID if detail else wire.Status.OK
        if status is not wire.Status.OK:
            self.stats.refused += 1
        try:
            if req.op is wire.Op.READ:
                await self._serve_read(ep, req, status, detail)
            else:
                await self._serve_write(ep, req, status, detail)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            self.stats.failed += 1
            logger.info("store %s request %d failed: %s", req.op.name, req.req_id, exc)

    async def _serve_read(self, ep, req: wire.Request, status: wire.Status, detail: str) -> None:
        sends = [ep.send(wire.encode_status(status, detail), tag=wire.tag(req.req_id, 0))]
        for i, (offset, nbytes) in enumerate(req.ranges):
            buf = self.segment[offset : offset + nbytes] if status is wire.Status.OK else _EMPTY
            sends.append(ep.send(buf, tag=wire.tag(req.req_id, 1 + i)))
        ok = await self._settle(ep, [asyncio.ensure_future(s) for s in sends])
        if ok and status is wire.Status.OK:
            self.stats.reads += 1
            self.stats.bytes_read += sum(n for _o, n in req.ranges)

    async def _serve_write(self, ep, req: wire.Request, status: wire.Status, detail: str) -> None:
        if status is wire.Status.OK:
            recvs = [
                asyncio.ensure_future(ep.recv(self.segment[offset : offset + nbytes], tag=wire.tag(req.req_id, 1 + i)))
                for i, (offset, nbytes) in enumerate(req.ranges)
            ]
            if not await self._settle(ep, recvs):
                status, detail = wire.Status.FAILED, "write did not complete"
                self.stats.failed += 1
                return  # the endpoint is aborted: the client sees the connection fail
            self.stats.writes += 1
            self.stats.bytes_written += sum(n for _o, n in req.ranges)
        reply = asyncio.ensure_future(ep.send(wire.encode_status(status, detail), tag=wire.tag(req.req_id, 0)))
        await self._settle(ep, [reply])

    async def _settle(self, ep, tasks: list[asyncio.Future]) -> bool:
        """Wait for ``tasks`` up to the I/O timeout; on failure abort ``ep`` so nothing stays posted."""
        ok = False
        try:
            done, pending = await asyncio.wait(tasks, timeout=self._io_timeout_s)
            ok = not pending and all(t.exception() is None for t in done)
        finally:
            if not ok:
                self._peers.discard(ep)
                abort_endpoint(ep)
                if any(not t.done() for t in tasks):
                    await asyncio.wait(tasks, timeout=1.0)
            consume(tasks)
        return ok
