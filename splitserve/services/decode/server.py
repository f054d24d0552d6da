"""DecodeService: the gRPC adapter of the decode worker (``worker.py`` holds the request logic).

It converts ``DecodeRequest`` to a :class:`DecodeJob`, streams the worker's outputs as ``DecodeResponse`` (choice
``index``, logprobs and, after a local prefill, the prompt's logprobs; ``kv_recomputed`` on the first one when the
worker recomputed the prompt's KV instead of pulling it, ``kv_transfer_us`` on the first one after a pull),
counts gRPC bytes and maps errors to status codes (``abort_with``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from splitserve.engine.async_engine import AsyncEngine
from splitserve.errors import KVTransferCancelled, PdError
from splitserve.engine.core import RequestOutput
from splitserve.rpc.convert import (
    FINISH_TO_PROTO, layout_to_proto, logprobs_to_proto, prompt_logprobs_to_proto, sampling_from_proto,
)
from splitserve.rpc.kv_handle import handle_from_proto
from splitserve.rpc.stats import GrpcByteCounter
from splitserve.rpc.status import abort_with
from splitserve.services.decode.kv_store import DecodeStore
from splitserve.services.decode.worker import DecodeJob, DecodeWorker
from splitserve.transfer.base import KVReceiver

logger = logging.getLogger(__name__)


def response_of(out: RequestOutput) -> decode_pb2.DecodeResponse:
    """One engine output as a DecodeResponse (``kv_recomputed`` left for the caller)."""
    msg = decode_pb2.DecodeResponse(token_ids=out.token_ids, finish_reason=FINISH_TO_PROTO[out.finish_reason],
                                    cached_tokens=out.cached_tokens, index=out.index,
                                    logprobs=logprobs_to_proto(out.logprobs))
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
    return msg


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Arguments as :class:`DecodeWorker`'s."""

    def __init__(
        self, engine: AsyncEngine, receiver: KVReceiver, transport: str, transfer_timeout_s: float,
        transfer_failure: str = "fallback", store: DecodeStore | None = None, push_timeout_s: float = 60.0,
        push_layer_groups: int = 0,
    ) -> None:
        self.engine = engine
        self.worker = DecodeWorker(engine, receiver, transport, transfer_timeout_s, transfer_failure, store,
                                   push_timeout_s, push_layer_groups)
        self.grpc_bytes = GrpcByteCounter()

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        self.grpc_bytes.received(request)
        try:
            job = DecodeJob(
                request.request_id, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                request.first_token_id if request.HasField("first_token_id") else None,
                handle_from_proto(request.kv_handle) if request.HasField("kv_handle") else None,
                context.time_remaining(), tuple(request.first_token_ids), tuple(request.resume_output_token_ids),
                request.push_bootstrap_id, request.push_endpoint,
            )
            first = True
            async with contextlib.aclosing(self.worker.decode(job)) as run:
                async for out in run:
                    msg = response_of(out)
                    if first:
                        first = False
                        msg.kv_recomputed, msg.kv_not_pulled = run.kv_recomputed, run.kv_not_pulled
                        if run.kv_transfer_s is not None and not run.kv_recomputed:
                            msg.kv_transfer_us = min(int(run.kv_transfer_s * 1e6), 2**32 - 1)
                    yield self.grpc_bytes.sent(msg)
        except PdError as exc:
            # a cancelled request (this call's or the prefill's: the router cancels both legs) is no fault
            quiet = isinstance(exc, KVTransferCancelled) or context.cancelled()
            logger.log(logging.INFO if quiet else logging.WARNING, "decode %s %s: %s", request.request_id,
                       "cancelled" if quiet else "failed", exc)
            await abort_with(context, exc)

    async def GetKVLayout(self, request, context) -> common_pb2.GetKVLayoutResponse:
        return common_pb2.GetKVLayoutResponse(layout=layout_to_proto(self.engine.layout.on_device(self.engine.kv_cache.device.type)))

    async def GetStats(self, request, context) -> common_pb2.GetStatsResponse:
        counters = await self.engine.stats(wait_for_step=False)  # never wait for a long step
        counters.update(self.worker.stats(), grpc_bytes_received=self.grpc_bytes.bytes_received,
                        grpc_bytes_sent=self.grpc_bytes.bytes_sent)
        return common_pb2.GetStatsResponse(counters=counters)
