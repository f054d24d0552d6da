"""Disaggregated generation: prefill on one worker, KV pulled by a decode worker, tokens streamed back.

Per request: pick a prefill and a decode worker (round robin) → PrefillService.Prefill →
the first token goes to the client at once (TTFT does not wait for the KV transfer) while
DecodeService.Decode starts with the KV handle → decode tokens stream through. Closing the
stream (stop string, client gone) cancels the decode call, which aborts the request there.

Failures, inside this request path (a smarter, load-aware policy can replace :meth:`_candidates`):

* Prefill fails before the first token (worker dead or unreachable, out of KV, hop timeout): retried on
  another prefill worker (``RetryPolicy.prefill_attempts``), then the decode worker prefills the prompt
  itself (a DecodeRequest without KV handle), unless ``local_prefill_fallback`` is off. Client errors
  (INVALID_ARGUMENT, FAILED_PRECONDITION) and an expired deadline are never retried.
* The decode call fails before its first message: retried on another decode worker with the same KV
  handle (``decode_attempts``); if the first one had already pulled the KV, the second recomputes it.
* Decode fails mid-stream: the request ends with a clear error (UNAVAILABLE); streamed tokens stand.
* KV that the prefill worker holds for a decode leg that never started, or that the decode worker
  recomputed instead of pulling (``kv_recomputed``), is released at once (ReleaseKV, in the background);
  otherwise the prefill worker's lease frees it.
* Deadlines: every hop gets the time left (:func:`splitserve.deadline.hop_timeout`); a request without
  a deadline gets none, except the prefill hop's liveness guard ``prefill_timeout_s`` (a hung prefill
  worker is retried elsewhere instead of holding the request forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve.deadline import hop_timeout, time_left
from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import FINISH_FROM_PROTO, layout_from_proto, sampling_to_proto
from splitserve.rpc.server import channel
from splitserve.rpc.status import error_from_rpc
from splitserve.rpc.tls import TlsConfig
from splitserve.telemetry.metrics import DISAGG_DECISIONS

logger = logging.getLogger(__name__)

#: status codes of a failed hop that another worker may not share
_RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    prefill_attempts: int = 2  # distinct prefill workers tried before giving up on remote prefill
    decode_attempts: int = 2  # distinct decode workers tried while no decode message has arrived
    local_prefill_fallback: bool = True  # after the prefill attempts, let the decode worker prefill

    def __post_init__(self) -> None:
        if self.prefill_attempts < 1 or self.decode_attempts < 1:
            raise ValueError(f"attempts must be >= 1: {self}")


class _Worker:
    def __init__(self, address: str, stub_cls, tls: TlsConfig | None) -> None:
        self.address = address
        self.channel = channel(address, tls)
        self.stub = stub_cls(self.channel)


class DisaggregatedBackend:
    """GenerationBackend over remote prefill and decode workers (round robin, retries, fallbacks)."""

    def __init__(
        self, prefill_addresses: list[str], decode_addresses: list[str], prefill_timeout_s: float | None = 60.0,
        *, tls: TlsConfig | None = None, retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        if not prefill_addresses or not decode_addresses:
            raise ValueError("need at least one prefill and one decode worker address")
        self.prefill_workers = [_Worker(a, prefill_pb2_grpc.PrefillServiceStub, tls) for a in prefill_addresses]
        self.decode_workers = [_Worker(a, decode_pb2_grpc.DecodeServiceStub, tls) for a in decode_addresses]
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()
        self.prefill_timeout_s = prefill_timeout_s or None
        self.retry = retry
        self.counters: Counter[str] = Counter()
        self.streams_open = 0
        self._background: set[asyncio.Task] = set()

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
        return any(results[n_p:]) and (any(results[:n_p]) or self.retry.local_prefill_fallback)

    def stats(self) -> dict[str, float]:
        return {"streams_open": self.streams_open, "background_tasks": len(self._background), **self.counters}

    # ------------------------------------------------------------------------------------------- generate
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens. ``deadline``: absolute ``time.monotonic()`` time, or None."""
        self.counters["requests"] += 1
        self.streams_open += 1
        try:
            sampling = sampling_to_proto(params)
            prefilled = await self._prefill(request_id, prompt_token_ids, sampling, deadline)
            if prefilled is None:  # no prefill worker could do it: the decode worker prefills
                decode_request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling)
                async with contextlib.aclosing(self._decode(decode_request, deadline, None)) as msgs:
                    async for msg in msgs:
                        yield _event(msg)
                return
            prefill, resp = prefilled
            finish = FINISH_FROM_PROTO[resp.finish_reason]
            if finish is not None or not resp.HasField("kv_handle"):
                yield TokenEvent([resp.first_token_id], finish or "stop", resp.cached_tokens)
                return
            DISAGG_DECISIONS.labels("remote_prefill").inc()
            decode_request = decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
                kv_handle=resp.kv_handle, first_token_id=resp.first_token_id,
            )
            started = False  # a decode worker has taken over the KV handle
            try:
                yield TokenEvent([resp.first_token_id], None, resp.cached_tokens)
                async with contextlib.aclosing(self._decode(decode_request, deadline, prefill)) as msgs:
                    async for msg in msgs:
                        started = True
                        yield _event(msg)
            finally:
                if not started:
                    self._release_soon(prefill, resp.kv_handle.transfer_id)
        finally:
            self.streams_open -= 1

    def _candidates(self, workers: list[_Worker], rr: Iterator[int], attempts: int) -> list[_Worker]:
        """Up to ``attempts`` distinct workers, starting at the next one in round-robin order."""
        start = next(rr)
        return [workers[(start + i) % len(workers)] for i in range(min(attempts, len(workers)))]

    def _retryable(self, exc: grpc.aio.AioRpcError, deadline: float | None) -> bool:
        left = time_left(deadline)
        return exc.code() in _RETRYABLE and (left is None or left > 0)

    async def _prefill(
        self, request_id: str, prompt: list[int], sampling: common_pb2.SamplingParams, deadline: float | None
    ) -> tuple[_Worker, prefill_pb2.PrefillResponse] | None:
        """(worker, response), or None when every attempt failed and the decode worker should prefill."""
        request = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
        last = None
        for attempt, worker in enumerate(self._candidates(self.prefill_workers, self._rr_prefill, self.retry.prefill_attempts)):
            if attempt:
                self.counters["prefill_retries"] += 1
            try:
                return worker, await worker.stub.Prefill(request, timeout=hop_timeout(deadline, self.prefill_timeout_s))
            except grpc.aio.AioRpcError as exc:
                last = error_from_rpc(exc, f"prefill worker {worker.address}")
                if not self._retryable(exc, deadline):
                    raise last from exc
                logger.warning("prefill of %s failed: %s", request_id, last)
        if not self.retry.local_prefill_fallback:
            raise last
        self.counters["local_prefill_fallbacks"] += 1
        logger.warning("prefill of %s: no prefill worker succeeded; the decode worker prefills it", request_id)
        return None

    async def _decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None, prefill: _Worker | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """Decode messages; retried on another decode worker while none has arrived."""
        workers = self._candidates(self.decode_workers, self._rr_decode, self.retry.decode_attempts)
        for attempt, worker in enumerate(workers):
            if attempt:
                self.counters["decode_retries"] += 1
            call = worker.stub.Decode(request, timeout=hop_timeout(deadline))
            received = False
            try:
                async for msg in call:
                    if not received and msg.kv_recomputed and prefill is not None:
                        self.counters["kv_recomputed"] += 1
                        self._release_soon(prefill, request.kv_handle.transfer_id)
                    received = True
                    yield msg
                return
            except grpc.aio.AioRpcError as exc:
                err = error_from_rpc(exc, f"decode worker {worker.address}")
                if received or attempt + 1 == len(workers) or not self._retryable(exc, deadline):
                    raise err from exc
                logger.warning("decode of %s failed before its first token: %s; retrying", request.request_id, err)
            finally:
                call.cancel()

    def _release_soon(self, prefill: _Worker, transfer_id: str) -> None:
        """Tell the prefill worker to free KV no decode worker will pull (best effort, in the background)."""
        task = asyncio.get_running_loop().create_task(self._release(prefill, transfer_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, prefill: _Worker, transfer_id: str) -> None:
        try:
            resp = await prefill.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=transfer_id), timeout=5)
            if resp.released:
                self.counters["kv_released"] += 1
        except grpc.aio.AioRpcError as exc:
            logger.warning("could not release KV %s on %s: %s", transfer_id, prefill.address, exc.code().name)
        except Exception as exc:  # e.g. the channel was closed at shutdown; the lease frees the KV
            logger.warning("could not release KV %s on %s: %r", transfer_id, prefill.address, exc)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=5)
        for w in self.prefill_workers + self.decode_workers:
            await w.channel.close()


def _event(msg: decode_pb2.DecodeResponse) -> TokenEvent:
    return TokenEvent(list(msg.token_ids), FINISH_FROM_PROTO[msg.finish_reason], msg.cached_tokens)
