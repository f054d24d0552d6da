"""PrefillService: runs the prompt, answers with the first token and a handle to the KV blocks.

Lifecycle of one request: Prefill RPC → engine prefill (batched with concurrent prompts) →
first token sampled → KV blocks held under a fresh transfer_id (KVLeases) → response with a
KVHandle → the decode worker pulls the blocks over the data plane (UCX) → blocks freed.
"""

from __future__ import annotations

import logging
import uuid

import grpc
from pd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from splitserve.services.prefill.kv_leases import KVLeases
from splitserve.services.prefill.kv_store import PrefillStore
from splitserve.engine.async_engine import AsyncEngine
from splitserve.errors import InvalidRequest, PdError
from splitserve.kvstore.kv_blocks import tail_key
from splitserve.rpc.convert import FINISH_TO_PROTO, layout_to_proto, sampling_from_proto
from splitserve.rpc.stats import GrpcByteCounter
from splitserve.rpc.status import abort_with
from splitserve.telemetry.workers import observe_prefill
from splitserve.transfer.base import KVSender

logger = logging.getLogger(__name__)
MAX_REQUEST_ID_LEN = 256


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(
        self, engine: AsyncEngine, sender: KVSender, transport: str, lease_s: float, store: PrefillStore | None = None,
        advertise: str | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.sender = sender
        self.transport = transport
        self.lease_s = lease_s
        self.advertise = advertise
        self.leases = KVLeases(sender, engine.free_blocks, lease_s)
        self.grpc_bytes = GrpcByteCounter()
        self.num_requests = 0
        self.in_flight = 0

    @property
    def endpoint(self) -> str:
        """The data-plane endpoint put in KV handles."""
        return self.advertise or self.sender.endpoint

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        self.grpc_bytes.received(request)
        request_id = request.request_id
        self.in_flight += 1
        try:  # a cancelled call (router gone, deadline) aborts the prefill in the engine: engine.prefill is cancel-safe
            if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
                raise InvalidRequest(f"request_id is required (1..{MAX_REQUEST_ID_LEN} characters)")
            params = sampling_from_proto(request.sampling)
            if not request.prompt_token_ids:
                raise InvalidRequest("prompt_token_ids is empty")
            prompt = list(request.prompt_token_ids)
            with observe_prefill(request_id, len(prompt)) as obs:
                if self.store is not None:
                    out = await self.store.prefill(request_id, prompt, params, context.time_remaining())
                else:
                    out = await self.engine.prefill(request_id, prompt, params)
                obs.done(out.cached_tokens, out.finish_reason)
        except PdError as exc:
            await abort_with(context, exc)
        finally:
            self.in_flight -= 1
        self.num_requests += 1
        response = prefill_pb2.PrefillResponse(
            request_id=request_id,
            first_token_id=out.token_ids[0],
            finish_reason=FINISH_TO_PROTO[out.finish_reason],
            cached_tokens=out.cached_tokens,
        )
        if out.block_ids is not None:
            transfer_id = uuid.uuid4().hex
            via_store = False
            if self.store is not None:
                try:
                    via_store = await self.store.publish(prompt, out, transfer_id)
                except BaseException:
                    self.engine.free_blocks(out.block_ids)
                    raise
            if via_store:
                self.engine.free_blocks(out.block_ids)  # the store write holds its own reference
            else:
                self.leases.hold(transfer_id, out.block_ids)
            response.kv_handle.CopyFrom(
                common_pb2.KVHandle(
                    request_id=request_id,
                    transfer_id=transfer_id,
                    num_tokens=len(request.prompt_token_ids),
                    layout=layout_to_proto(self.engine.layout),
                    transport=self.transport,
                    endpoint=self.endpoint,
                    block_ids=out.block_ids,
                    lease_ms=int(self.lease_s * 1000),
                    via_store=via_store,
                    store_tail_key=tail_key(transfer_id) if via_store and len(prompt) % self.engine.layout.block_size else "",
                )
            )
        return self.grpc_bytes.sent(response)

    async def ReleaseKV(self, request: prefill_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.ReleaseKVResponse:
        return prefill_pb2.ReleaseKVResponse(released=self.leases.release(request.transfer_id))

    async def GetKVLayout(self, request, context) -> common_pb2.GetKVLayoutResponse:
        return common_pb2.GetKVLayoutResponse(layout=layout_to_proto(self.engine.layout))

    async def GetStats(self, request, context) -> common_pb2.GetStatsResponse:
        counters = await self.engine.stats()
        s = self.sender.stats
        counters.update(
            requests=self.num_requests,
            prefills_in_flight=self.in_flight,
            kv_transfers_held=len(self.leases),
            kv_leases_expired=self.leases.expired,
            ucx_bytes_sent=s.bytes_sent if self.transport == "ucx" else 0,
            kv_bytes_sent=s.bytes_sent,
            kv_transfers_ok=s.transfers_ok,
            kv_transfers_failed=s.transfers_failed,
            grpc_bytes_received=self.grpc_bytes.bytes_received,
            grpc_bytes_sent=self.grpc_bytes.bytes_sent,
        )
        if self.store is not None:
            counters.update(self.store.stats())
        return common_pb2.GetStatsResponse(counters=counters)
