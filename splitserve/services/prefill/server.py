"""PrefillService: the gRPC adapter of the prefill worker (``worker.py`` holds the request logic).

It converts ``PrefillRequest`` to plain values, answers with the worker's first tokens (one per choice, with their
logprobs and the prompt's when asked) and KV handle, counts gRPC bytes and maps errors to status codes
(``abort_with``). A cancelled call (router gone, deadline) aborts the prefill in the engine.
"""

from __future__ import annotations

import grpc
from pd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from splitserve.engine.async_engine import AsyncEngine
from splitserve.errors import PdError
from splitserve.rpc.convert import (
    FINISH_TO_PROTO, layout_to_proto, logprobs_to_proto, prompt_logprobs_to_proto, sampling_from_proto,
)
from splitserve.rpc.kv_handle import handle_to_proto
from splitserve.rpc.stats import GrpcByteCounter
from splitserve.rpc.status import abort_with
from splitserve.services.prefill.kv_leases import KVLeases
from splitserve.services.prefill.kv_store import PrefillStore
from splitserve.services.prefill.worker import PrefillWorker
from splitserve.transfer.base import KVSender


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Arguments as :class:`PrefillWorker`'s."""

    def __init__(
        self, engine: AsyncEngine, sender: KVSender, transport: str, lease_s: float, store: PrefillStore | None = None,
        advertise: str | None = None,
    ) -> None:
        self.engine = engine
        self.worker = PrefillWorker(engine, sender, transport, lease_s, store, advertise)
        self.grpc_bytes = GrpcByteCounter()

    @property
    def endpoint(self) -> str:
        """The data-plane endpoint put in KV handles."""
        return self.worker.endpoint

    @property
    def leases(self) -> KVLeases:
        """The KV held for decode workers to pull."""
        return self.worker.leases

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        self.grpc_bytes.received(request)
        try:
            params = sampling_from_proto(request.sampling)
            out = await self.worker.prefill(request.request_id, list(request.prompt_token_ids), params, context.time_remaining(),
                                            request.push_bootstrap_id)
        except PdError as exc:
            await abort_with(context, exc)
        response = prefill_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=out.first_token_id,
            finish_reason=FINISH_TO_PROTO[out.finish_reason], cached_tokens=out.cached_tokens,
            first_token_ids=out.first_token_ids, first_logprobs=logprobs_to_proto(out.first_logprobs),
            finish_reasons=[FINISH_TO_PROTO[f] for f in out.finish_reasons], kv_pushed=out.pushed,
        )
        if out.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
        if out.handle is not None:
            response.kv_handle.CopyFrom(handle_to_proto(out.handle))
        return self.grpc_bytes.sent(response)

    async def ReleaseKV(self, request: prefill_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.ReleaseKVResponse:
        return prefill_pb2.ReleaseKVResponse(released=self.worker.release(request.transfer_id))

    async def GetKVLayout(self, request, context) -> common_pb2.GetKVLayoutResponse:
        layout = self.engine.layout.on_device(self.engine.kv_cache.device.type)
        return common_pb2.GetKVLayoutResponse(layout=layout_to_proto(layout), kv_endpoint=self.endpoint)

    async def GetStats(self, request, context) -> common_pb2.GetStatsResponse:
        counters = await self.engine.stats(wait_for_step=False)  # never wait for a long step
        counters.update(self.worker.stats(), grpc_bytes_received=self.grpc_bytes.bytes_received,
                        grpc_bytes_sent=self.grpc_bytes.bytes_sent)
        return common_pb2.GetStatsResponse(counters=counters)
