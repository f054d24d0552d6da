"""DecodeService: pulls a request's KV blocks from its prefill worker and streams the tokens after the first.

Lifecycle of one request: Decode RPC → KV layout check (FAILED_PRECONDITION on mismatch) →
allocate local KV blocks → pull the prefill worker's blocks straight into them over the data
plane (UCX) → join the running decode batch (continuous batching) → stream tokens → finish,
cancel or error frees the blocks. Without a KV handle the request is prefilled here.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from splitserve.services.decode.kv_store import DecodeStore
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.core import RequestOutput
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest, PdError
from splitserve.rpc.convert import FINISH_TO_PROTO, layout_from_proto, layout_to_proto, sampling_from_proto
from splitserve.rpc.stats import GrpcByteCounter
from splitserve.rpc.status import abort_with
from splitserve.telemetry.transfer import observe_receive
from splitserve.telemetry.workers import observe_decode
from splitserve.transfer.base import KVReceiver

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, transport: str, transfer_timeout_s: float,
                 store: DecodeStore | None = None) -> None:
        self.engine = engine
        self.store = store
        self.receiver = receiver
        self.transport = transport
        self.transfer_timeout_s = transfer_timeout_s
        self.grpc_bytes = GrpcByteCounter()
        self.num_requests = 0
        self.num_local_prefills = 0

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        self.grpc_bytes.received(request)
        self.num_requests += 1
        try:
            params = sampling_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            if request.HasField("kv_handle"):
                stream = await self._pull_and_decode(request, prompt, params)
            else:
                self.num_local_prefills += 1
                stream = self.engine.generate(request.request_id, prompt, params)
            async for out in observe_decode(stream, request.request_id, local_prefill=not request.HasField("kv_handle")):
                yield self.grpc_bytes.sent(self._response(out))
        except PdError as exc:
            logger.warning("decode %s failed: %s", request.request_id, exc)
            await abort_with(context, exc)

    async def _pull_and_decode(self, request: decode_pb2.DecodeRequest, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        handle = request.kv_handle
        self.engine.layout.check_compatible(layout_from_proto(handle.layout))
        if handle.transport != self.transport:
            raise InvalidRequest(f"KV handle transport {handle.transport!r}; this worker receives over {self.transport!r}")
        bs = self.engine.layout.block_size
        if handle.num_tokens != len(prompt) or len(handle.block_ids) != -(-len(prompt) // bs):
            raise InvalidRequest(
                f"KV handle covers {handle.num_tokens} tokens in {len(handle.block_ids)} blocks; prompt has {len(prompt)} tokens"
            )
        if params.max_tokens <= 1:
            raise InvalidRequest("max_tokens <= 1: the request finished at prefill; nothing to decode")
        block_ids = await self.engine.allocate_blocks(len(handle.block_ids))
        try:
            computed = None
            if handle.via_store:  # store transfer mode: read from the KV store, recompute what is missing
                computed = await self.store.load_prompt(handle, prompt, block_ids) if self.store is not None else 0
            else:
                with observe_receive(self.transport, handle.endpoint, handle.transfer_id, len(block_ids)) as obs:
                    obs.nbytes = await self.receiver.fetch(handle.endpoint, handle.transfer_id, list(handle.block_ids), block_ids, self.transfer_timeout_s)
            stream = self.engine.decode_prefilled(request.request_id, prompt, params, request.first_token_id, block_ids, computed)
        except BaseException:
            self.engine.free_blocks(block_ids)
            raise
        return stream

    @staticmethod
    def _response(out: RequestOutput) -> decode_pb2.DecodeResponse:
        return decode_pb2.DecodeResponse(
            token_ids=out.token_ids, finish_reason=FINISH_TO_PROTO[out.finish_reason], cached_tokens=out.cached_tokens
        )

    async def GetKVLayout(self, request, context) -> common_pb2.GetKVLayoutResponse:
        return common_pb2.GetKVLayoutResponse(layout=layout_to_proto(self.engine.layout))

    async def GetStats(self, request, context) -> common_pb2.GetStatsResponse:
        counters = await self.engine.stats()
        s = self.receiver.stats
        counters.update(
            requests=self.num_requests,
            local_prefills=self.num_local_prefills,
            ucx_bytes_received=s.bytes_received if self.transport == "ucx" else 0,
            kv_bytes_received=s.bytes_received,
            kv_transfers_ok=s.transfers_ok,
            kv_transfers_failed=s.transfers_failed,
            grpc_bytes_received=self.grpc_bytes.bytes_received,
            grpc_bytes_sent=self.grpc_bytes.bytes_sent,
        )
        if self.store is not None:
            counters.update(self.store.stats())
        return common_pb2.GetStatsResponse(counters=counters)
