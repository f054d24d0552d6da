"""KVStoreNodeService (stats) and the node's membership at the master: mount, heartbeat, unmount."""

from __future__ import annotations

import asyncio
import logging

import grpc
from pd.v1 import common_pb2, kvstore_pb2 as kv, kvstore_pb2_grpc

from splitserve.services.kvstore.node.segment_server import SegmentServer

logger = logging.getLogger("splitserve.kvstore.node")


class KVStoreNodeServicer(kvstore_pb2_grpc.KVStoreNodeServiceServicer):
    def __init__(self, segment: SegmentServer, membership: "Membership") -> None:
        self.segment = segment
        self.membership = membership

    async def GetStats(self, request, context) -> common_pb2.GetStatsResponse:
        counters = {f"ucx_{k}": v for k, v in self.segment.stats.as_dict().items()}
        counters.update(segment_bytes=self.segment.nbytes, mounted=float(self.membership.mounted),
                        mounts=self.membership.mounts, heartbeats_failed=self.membership.heartbeats_failed)
        return common_pb2.GetStatsResponse(counters=counters)


class Membership:
    """Keeps this node's segment mounted at the master: mounts, heartbeats at the master's interval, and
    mounts again whenever the master does not know the node (it restarted or declared the node dead)."""

    def __init__(self, stub: kvstore_pb2_grpc.KVStoreMasterServiceStub, node_id: str, endpoint: str, nbytes: int,
                 rpc_timeout_s: float) -> None:
        self._stub = stub
        self.node_id = node_id
        self._endpoint = endpoint
        self._nbytes = nbytes
        self._timeout = rpc_timeout_s
        self._interval_s = 1.0
        self.mounted = False
        self.mounts = 0
        self.heartbeats_failed = 0

    async def mount(self) -> None:
        resp = await self._stub.MountSegment(
            kv.MountSegmentRequest(node_id=self.node_id, endpoint=self._endpoint, size=self._nbytes), timeout=self._timeout
        )
        self._interval_s = max(0.05, resp.heartbeat_interval_ms / 1000)
        self.mounted = True
        self.mounts += 1
        logger.info("segment of %s mounted at the master (%d bytes, data %s)", self.node_id, self._nbytes, self._endpoint)

    async def run(self) -> None:
        """Heartbeat forever (cancel to stop); never raises on master errors, retries instead."""
        while True:
            try:
                if not self.mounted:
                    await self.mount()
                else:
                    resp = await self._stub.Heartbeat(kv.HeartbeatRequest(node_id=self.node_id), timeout=self._timeout)
                    if not resp.known:
                        logger.warning("master does not know %s (restarted or declared it dead): mounting again", self.node_id)
                        self.mounted = False
                        continue
            except grpc.aio.AioRpcError as exc:
                self.heartbeats_failed += 1
                logger.warning("master unreachable from %s: %s", self.node_id, exc.code().name)
            await asyncio.sleep(self._interval_s)

    async def unmount(self) -> None:
        if not self.mounted:
            return
        self.mounted = False
        try:
            await self._stub.UnmountSegment(kv.UnmountSegmentRequest(node_id=self.node_id), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            logger.info("unmount of %s failed (master gone?): %s", self.node_id, exc.code().name)
