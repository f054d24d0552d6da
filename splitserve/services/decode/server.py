"""DecodeService: pulls a request's KV blocks from its prefill worker and streams the tokens after the first.

Lifecycle of one request: Decode RPC → checks (router-only fields present, KV layout: FAILED_PRECONDITION
on mismatch) → allocate local KV blocks → pull the prefill worker's blocks straight into them over the
data plane (UCX), within min(--kv-transfer-timeout-s, the call's deadline) and optionally verified by
checksum → join the running decode batch (continuous batching) → stream tokens → finish, cancel,
deadline or error frees the blocks. Without a KV handle the request is prefilled here.

When the pull fails (data path unreachable, timeout, lease expired, corrupted) the worker, by default
(``--kv-transfer-failure fallback``), frees the blocks, recomputes the prompt's KV itself and continues
from the first token prefill produced; the first response then has ``kv_recomputed`` set so the caller
releases the KV the prefill worker still holds. With ``error`` the call fails (UNAVAILABLE / NOT_FOUND).
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from splitserve.services.decode.kv_store import DecodeStore
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.core import RequestOutput
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest, KVTransferError, PdError, TransferNotFound
from splitserve.rpc.convert import FINISH_TO_PROTO, layout_from_proto, layout_to_proto, sampling_from_proto
from splitserve.rpc.stats import GrpcByteCounter
from splitserve.rpc.status import abort_with
from splitserve.telemetry.transfer import observe_receive
from splitserve.telemetry.workers import observe_decode
from splitserve.transfer.base import KVReceiver

logger = logging.getLogger(__name__)

#: the local prefill of a fallback only rebuilds the prompt's KV; its sampled token is discarded
_RECOMPUTE = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
MAX_REQUEST_ID_LEN = 256


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self, engine: AsyncEngine, receiver: KVReceiver, transport: str, transfer_timeout_s: float,
        transfer_failure: str = "fallback", store: DecodeStore | None = None,
    ) -> None:
        if transfer_failure not in ("fallback", "error"):
            raise ValueError(f"transfer_failure must be 'fallback' or 'error', got {transfer_failure!r}")
        self.engine = engine
        self.store = store
        self.receiver = receiver
        self.transport = transport
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_failure = transfer_failure
        self.grpc_bytes = GrpcByteCounter()
        self.num_requests = 0
        self.num_local_prefills = 0
        self.num_kv_fallbacks = 0
        self.streams_open = 0

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        self.grpc_bytes.received(request)
        self.num_requests += 1
        self.streams_open += 1
        try:
            try:
                params = self._check(request)
                prompt = list(request.prompt_token_ids)
                recomputed = False
                if request.HasField("kv_handle"):
                    stream, recomputed = await self._pull_and_decode(request, prompt, params, context.time_remaining())
                else:
                    self.num_local_prefills += 1
                    stream = self.engine.generate(request.request_id, prompt, params)
                observed = observe_decode(stream, request.request_id, local_prefill=not request.HasField("kv_handle") or recomputed)
                async with contextlib.aclosing(observed):  # cancelled or gone: the engine aborts at once
                    async for out in observed:
                        msg = self._response(out)
                        if recomputed:
                            msg.kv_recomputed, recomputed = True, False
                        yield self.grpc_bytes.sent(msg)
            except PdError as exc:
                logger.warning("decode %s failed: %s", request.request_id, exc)
                await abort_with(context, exc)
        finally:
            self.streams_open -= 1

    def _check(self, request: decode_pb2.DecodeRequest) -> SamplingParams:
        """Refuse requests that lack what only the router supplies (a direct client's malformed call)."""
        if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequest(f"request_id is required (1..{MAX_REQUEST_ID_LEN} characters)")
        params = sampling_from_proto(request.sampling)
        if request.HasField("kv_handle"):
            h = request.kv_handle
            if not request.HasField("first_token_id"):
                raise InvalidRequest("first_token_id is required with a kv_handle")
            if not h.transfer_id or not h.endpoint or not h.block_ids:
                raise InvalidRequest("kv_handle needs transfer_id, endpoint and block_ids")
        return params

    async def _pull_and_decode(
        self, request: decode_pb2.DecodeRequest, prompt: list[int], params: SamplingParams, time_remaining: float | None
    ) -> tuple[AsyncIterator[RequestOutput], bool]:
        """(token stream, whether the prompt's KV was recomputed here instead of pulled)."""
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
        timeout = self.transfer_timeout_s if time_remaining is None else max(0.001, min(self.transfer_timeout_s, time_remaining))
        self.engine.check_capacity(len(prompt), params)  # could never fit this pool: refuse before taking blocks
        block_ids = await self.engine.allocate_blocks(len(handle.block_ids))  # waits (bounded) while the pool is busy
        try:
            computed = None
            if handle.via_store:  # store transfer mode: read from the KV store, recompute what is missing
                computed = await self.store.load_prompt(handle, prompt, block_ids, timeout) if self.store is not None else 0
            else:
                with observe_receive(self.transport, handle.endpoint, handle.transfer_id, len(block_ids)) as obs:
                    obs.nbytes = await self.receiver.fetch(
                        handle.endpoint, handle.transfer_id, list(handle.block_ids), block_ids, timeout
                    )
        except (KVTransferError, TransferNotFound) as exc:  # incl. timeout, unreachable, checksum mismatch
            self.engine.free_blocks(block_ids)
            if self.transfer_failure == "error":
                raise
            self.num_kv_fallbacks += 1
            logger.warning("KV pull for %s failed (%s); recomputing its prompt here", request.request_id, exc)
            return self._recompute_and_decode(request.request_id, prompt, params, request.first_token_id), True
        except BaseException:
            self.engine.free_blocks(block_ids)
            raise
        try:
            return self.engine.decode_prefilled(request.request_id, prompt, params, request.first_token_id, block_ids, computed), False
        except BaseException:
            self.engine.free_blocks(block_ids)
            raise

    async def _recompute_and_decode(
        self, request_id: str, prompt: list[int], params: SamplingParams, first_token_id: int
    ) -> AsyncIterator[RequestOutput]:
        """Rebuild the prompt's KV with a local prefill, then continue after ``first_token_id``."""
        out = await self.engine.prefill(f"{request_id}#recompute", prompt, _RECOMPUTE)
        if out.block_ids is None:  # only if the prompt fills the context: then there is nothing to decode
            raise InvalidRequest("the prompt leaves no room to decode")
        try:
            stream = self.engine.decode_prefilled(request_id, prompt, params, first_token_id, out.block_ids)
        except BaseException:
            self.engine.free_blocks(out.block_ids)
            raise
        async with contextlib.aclosing(stream):
            async for item in stream:
                yield item

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
            streams_open=self.streams_open,
            local_prefills=self.num_local_prefills,
            kv_transfer_fallbacks=self.num_kv_fallbacks,
            kv_checksum_failures=s.checksum_failures,
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
