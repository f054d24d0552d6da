"""Disaggregated generation: prefill on one worker, KV pulled by a decode worker, tokens streamed back.

Per request: pick a prefill and a decode worker (round robin) → PrefillService.Prefill →
the first token goes to the client at once (TTFT does not wait for the KV transfer) while
DecodeService.Decode starts with the KV handle → decode tokens stream through. Closing the
stream (stop string, client gone) cancels the decode call, which aborts the request there; if
the decode leg never starts, the prefill worker is told to release the KV.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator

import grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import FINISH_FROM_PROTO, layout_from_proto, sampling_to_proto
from splitserve.rpc.server import insecure_channel
from splitserve.rpc.status import error_from_rpc
from splitserve.telemetry.metrics import DISAGG_DECISIONS

logger = logging.getLogger(__name__)


class _Worker:
    def __init__(self, address: str, stub_cls) -> None:
        self.address = address
        self.channel = insecure_channel(address)
        self.stub = stub_cls(self.channel)


class DisaggregatedBackend:
    """GenerationBackend over remote prefill and decode workers (round robin)."""

    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str], prefill_timeout_s: float = 60.0) -> None:
        if not prefill_addresses or not decode_addresses:
            raise ValueError("need at least one prefill and one decode worker address")
        self.prefill_workers = [_Worker(a, prefill_pb2_grpc.PrefillServiceStub) for a in prefill_addresses]
        self.decode_workers = [_Worker(a, decode_pb2_grpc.DecodeServiceStub) for a in decode_addresses]
        self._next_prefill = itertools.cycle(self.prefill_workers)
        self._next_decode = itertools.cycle(self.decode_workers)
        self.prefill_timeout_s = prefill_timeout_s

    async def check_layouts(self, retry_s: float = 1.0) -> None:
        """Log an error for every prefill/decode pair whose KV layouts differ (requests to such a pair
        fail with FAILED_PRECONDITION). Retries workers that are still starting."""
        layouts = {}
        while len(layouts) < len(self.prefill_workers) + len(self.decode_workers):
            for w in self.prefill_workers + self.decode_workers:
                if w.address in layouts:
                    continue
                try:
                    resp = await w.stub.GetKVLayout(common_pb2.GetKVLayoutRequest(), timeout=5)
                    layouts[w.address] = layout_from_proto(resp.layout)
                except grpc.aio.AioRpcError:
                    pass
            if len(layouts) < len(self.prefill_workers) + len(self.decode_workers):
                await asyncio.sleep(retry_s)
        for p in self.prefill_workers:
            for d in self.decode_workers:
                if layouts[p.address] != layouts[d.address]:
                    logger.error("KV layout of prefill %s [%s] differs from decode %s [%s]", p.address,
                                 layouts[p.address].describe(), d.address, layouts[d.address].describe())

    async def ready(self) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async def ok(w: _Worker) -> bool:
            try:
                r = await health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                return r.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                return False

        results = await asyncio.gather(*(ok(w) for w in self.prefill_workers + self.decode_workers))
        n_p = len(self.prefill_workers)
        return any(results[:n_p]) and any(results[n_p:])

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        prefill, decode = next(self._next_prefill), next(self._next_decode)
        sampling = sampling_to_proto(params)
        try:
            resp = await prefill.stub.Prefill(
                prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling),
                timeout=self.prefill_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"prefill worker {prefill.address}") from exc
        finish = FINISH_FROM_PROTO[resp.finish_reason]
        if finish is not None or not resp.HasField("kv_handle"):
            yield TokenEvent([resp.first_token_id], finish or "stop", resp.cached_tokens)
            return
        DISAGG_DECISIONS.labels("remote_prefill").inc()
        call = decode.stub.Decode(
            decode_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling,
                kv_handle=resp.kv_handle,
                first_token_id=resp.first_token_id,
            )
        )
        started = False
        try:
            yield TokenEvent([resp.first_token_id], None, resp.cached_tokens)
            async for msg in call:
                started = True
                finish = FINISH_FROM_PROTO[msg.finish_reason]
                if finish is not None:  # let the stream end by itself: a cancel here would race its OK status
                    await asyncio.wait([asyncio.ensure_future(call.code())], timeout=1.0)
                yield TokenEvent(list(msg.token_ids), finish, msg.cached_tokens)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"decode worker {decode.address}") from exc
        finally:
            if not call.done():
                call.cancel()
            if not started:
                await self._release(prefill, resp.kv_handle.transfer_id)

    @staticmethod
    async def _release(prefill: _Worker, transfer_id: str) -> None:
        try:
            await prefill.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=transfer_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            logger.warning("could not release KV %s on %s: %s", transfer_id, prefill.address, exc.code().name)

    async def close(self) -> None:
        for w in self.prefill_workers + self.decode_workers:
            await w.channel.close()


