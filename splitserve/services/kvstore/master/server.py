"""KVStoreMasterService: a thin gRPC face over :class:`KVStoreMaster` (control only, no object bytes).

Single-object RPCs fail with the gRPC status of the typed error (``splitserve.rpc.status``); batch RPCs
answer one ``StoreStatus`` per key and fail only as a whole. A background task runs ``tick`` (dead
nodes, zombie writes) every ``tick_s``.
"""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import common_pb2, kvstore_pb2 as kv, kvstore_pb2_grpc

from splitserve.errors import InvalidRequest, PdError
from splitserve.rpc.stats import GrpcByteCounter
from splitserve.rpc.status import abort_with, store_status_for
from splitserve.services.kvstore.master.core import KVStoreMaster, Location, PutTicket, ReadGrant

logger = logging.getLogger(__name__)


def _replicas(locations: list[Location]) -> list[kv.Replica]:
    return [kv.Replica(node_id=l.node_id, endpoint=l.endpoint, offset=l.offset, size=l.size) for l in locations]


def _put_result(key: str, ticket: PutTicket) -> kv.PutStartResponse:
    return kv.PutStartResponse(key=key, status=kv.STORE_STATUS_OK, put_id=ticket.put_id, replicas=_replicas(ticket.replicas))


def _get_result(key: str, grant: ReadGrant) -> kv.GetReplicaListResponse:
    return kv.GetReplicaListResponse(
        key=key, status=kv.STORE_STATUS_OK, replicas=_replicas(grant.replicas), size=grant.size,
        checksum=grant.checksum, lease_ms=int(grant.lease_s * 1000), state=kv.OBJECT_STATE_COMPLETE,
    )


class KVStoreMasterServicer(kvstore_pb2_grpc.KVStoreMasterServiceServicer):
    def __init__(self, master: KVStoreMaster) -> None:
        self.master = master
        self.grpc_bytes = GrpcByteCounter()

    async def run_ticks(self) -> None:
        """Sweep dead nodes and zombie writes forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.master.config.tick_s)
            try:
                self.master.tick()
            except Exception:  # keep sweeping
                logger.exception("master tick failed")

    def _check_batch(self, n: int) -> None:
        if n > self.master.config.max_batch:
            raise InvalidRequest(f"batch of {n} keys exceeds {self.master.config.max_batch}")

    async def _call(self, context, fn, request):
        self.grpc_bytes.received(request)
        try:
            return self.grpc_bytes.sent(fn())
        except PdError as exc:
            await abort_with(context, exc)

    # ---------------------------------------------------------------- segments
    async def MountSegment(self, request, context):
        def run():
            self.master.mount_segment(request.node_id, request.endpoint, request.size)
            cfg = self.master.config
            return kv.MountSegmentResponse(heartbeat_interval_ms=int(cfg.heartbeat_interval_s * 1000),
                                           heartbeat_timeout_ms=int(cfg.heartbeat_timeout_s * 1000))
        return await self._call(context, run, request)

    async def UnmountSegment(self, request, context):
        return await self._call(context, lambda: kv.UnmountSegmentResponse(replicas_dropped=self.master.unmount_segment(request.node_id)), request)

    async def Heartbeat(self, request, context):
        return await self._call(context, lambda: kv.HeartbeatResponse(known=self.master.heartbeat(request.node_id)), request)

    # ---------------------------------------------------------------- single-object calls
    async def PutStart(self, request, context):
        return await self._call(context, lambda: _put_result(request.key, self.master.put_start(request.key, request.size, request.replicas)),
                                request)

    async def PutEnd(self, request, context):
        def run():
            self.master.put_end(request.key, request.put_id, request.checksum)
            return kv.PutEndResponse(key=request.key, status=kv.STORE_STATUS_OK)
        return await self._call(context, run, request)

    async def PutRevoke(self, request, context):
        def run():
            self.master.put_revoke(request.key, request.put_id, list(request.failed_node_ids))
            return kv.PutRevokeResponse(key=request.key, status=kv.STORE_STATUS_OK)
        return await self._call(context, run, request)

    async def GetReplicaList(self, request, context):
        return await self._call(context, lambda: _get_result(request.key, self.master.get_replica_list(request.key)), request)

    async def Exist(self, request, context):
        return await self._call(context, lambda: kv.ExistResponse(exists=self.master.exist(request.key)), request)

    async def Remove(self, request, context):
        def run():
            self.master.remove(request.key, request.ignore_lease)
            return kv.RemoveResponse(key=request.key, status=kv.STORE_STATUS_OK)
        return await self._call(context, run, request)

    # ---------------------------------------------------------------- batch calls
    async def BatchPutStart(self, request, context):
        def run():
            self._check_batch(len(request.keys))
            results = []
            for key in request.keys:
                try:
                    results.append(_put_result(key, self.master.put_start(key, request.size, request.replicas)))
                except PdError as exc:
                    results.append(kv.PutStartResponse(key=key, status=store_status_for(exc), detail=str(exc)))
            return kv.BatchPutStartResponse(results=results)
        return await self._call(context, run, request)

    async def BatchPutEnd(self, request, context):
        def run():
            self._check_batch(len(request.items))
            results = []
            for item in request.items:
                try:
                    self.master.put_end(item.key, item.put_id, item.checksum)
                    results.append(kv.PutEndResponse(key=item.key, status=kv.STORE_STATUS_OK))
                except PdError as exc:
                    results.append(kv.PutEndResponse(key=item.key, status=store_status_for(exc), detail=str(exc)))
            return kv.BatchPutEndResponse(results=results)
        return await self._call(context, run, request)

    async def BatchPutRevoke(self, request, context):
        def run():
            self._check_batch(len(request.items))
            results = []
            for item in request.items:
                try:
                    self.master.put_revoke(item.key, item.put_id, list(item.failed_node_ids))
                    results.append(kv.PutRevokeResponse(key=item.key, status=kv.STORE_STATUS_OK))
                except PdError as exc:
                    results.append(kv.PutRevokeResponse(key=item.key, status=store_status_for(exc), detail=str(exc)))
            return kv.BatchPutRevokeResponse(results=results)
        return await self._call(context, run, request)

    async def BatchGetReplicaList(self, request, context):
        def run():
            self._check_batch(len(request.keys))
            results = []
            for key in request.keys:
                try:
                    results.append(_get_result(key, self.master.get_replica_list(key)))
                except PdError as exc:
                    status = store_status_for(exc)
                    state = kv.OBJECT_STATE_PROCESSING if status == kv.STORE_STATUS_NOT_READY else kv.OBJECT_STATE_UNSPECIFIED
                    results.append(kv.GetReplicaListResponse(key=key, status=status, detail=str(exc), state=state))
                    if request.prefix:
                        break
            return kv.BatchGetReplicaListResponse(results=results)
        return await self._call(context, run, request)

    async def BatchExist(self, request, context):
        def run():
            self._check_batch(len(request.keys))
            return kv.BatchExistResponse(exists=[self.master.exist(k) for k in request.keys])
        return await self._call(context, run, request)

    async def GetStats(self, request, context):
        counters = self.master.stats()
        counters.update(grpc_bytes_received=self.grpc_bytes.bytes_received, grpc_bytes_sent=self.grpc_bytes.bytes_sent)
        return common_pb2.GetStatsResponse(counters=counters)
