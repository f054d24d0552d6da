"""RoutedBackend: disaggregated generation over the worker registry, a routing policy, conditional
disaggregation and failover.

Per request:

1. Pick a decode worker and (independently) a prefill worker with the policy, among workers up now.
2. Conditional disaggregation decides local or remote prefill from the *uncached* prompt tokens.
3. Remote: Prefill on the prefill worker. A failure before the first token (UNAVAILABLE, deadline,
   overload, internal) moves the request to another prefill worker (at most ``prefill_attempts`` in
   all), then to local prefill on the decode worker (a DecodeRequest without kv_handle).
4. Decode: a decode worker unreachable before its stream starts is marked down and another is chosen
   (at most ``decode_attempts``); the KV handle stays valid (the prefill worker holds it on a lease).
5. Once tokens flow from a decode stream, a failure ends the request with a typed error (an SSE error
   event / a gRPC status at the front ends), never a hang, and is not retried (tokens already sent).
6. Hung workers: gRPC keepalive fails the calls to a stopped or unreachable worker with UNAVAILABLE
   (``splitserve.rpc.keepalive``); a decode stream that sends nothing for ``decode_stall_timeout_s`` fails the
   same way (``stall.py``). Either takes the worker out of rotation, before or after the first token.

Clients cannot pick workers: addresses come only from the registry (router configuration).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import AsyncIterator

import grpc
from pd.v1 import decode_pb2, prefill_pb2

from splitserve.deadline import hop_timeout, time_left
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import StreamStalled, WorkerUnavailable
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import FINISH_FROM_PROTO, sampling_to_proto
from splitserve.rpc.status import error_from_rpc
from splitserve.services.router.backend import DisaggregatedBackend
from splitserve.services.router.disaggregation import DisaggregationPolicy
from splitserve.services.router.policies import Policy, RoundRobin
from splitserve.services.router.registry import DECODE, PREFILL, WorkerRegistry, WorkerState
from splitserve.services.router.stall import stall_guard
from splitserve.telemetry.metrics import DISAGG_DECISIONS, ROUTER_FAILOVERS, ROUTER_WORKER_PICKS

logger = logging.getLogger(__name__)

# Codes after which the same request may be tried elsewhere (nothing reached the client yet).
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
})
_DOWN = frozenset({grpc.StatusCode.UNAVAILABLE})  # the worker itself is unreachable: out of rotation now


class RoutedBackend(DisaggregatedBackend):
    """GenerationBackend over a :class:`WorkerRegistry` (see the module docstring).

    Args:
        registry: the workers (its poll loop is started by :meth:`start`).
        policy: routing policy (default round robin).
        disagg: conditional disaggregation (default: always remote).
        prefill_timeout_s: deadline of one Prefill call.
        prefill_attempts / decode_attempts: bounded tries on distinct workers of each role.
        wait_for_workers_s: how long a request waits for a worker of a role to be up before failing
            with UNAVAILABLE (covers start-up and a short outage).
        decode_stall_timeout_s: a decode stream with no message for this long fails as UNAVAILABLE (None: no limit).
    """

    def __init__(self, registry: WorkerRegistry, policy: Policy | None = None, disagg: DisaggregationPolicy | None = None,
                 *, prefill_timeout_s: float = 60.0, prefill_attempts: int = 2, decode_attempts: int = 2,
                 wait_for_workers_s: float = 5.0, local_prefill_fallback: bool = True,
                 decode_stall_timeout_s: float | None = 60.0) -> None:
        self.registry = registry
        self.prefill_workers = registry.workers[PREFILL]  # for check_layouts of the base class
        self.decode_workers = registry.workers[DECODE]
        self.policy = policy or RoundRobin()
        self.disagg = disagg or DisaggregationPolicy("always")
        self.prefill_timeout_s = prefill_timeout_s
        self.prefill_attempts, self.decode_attempts = max(prefill_attempts, 1), max(decode_attempts, 1)
        self.wait_for_workers_s = wait_for_workers_s
        self.local_prefill_fallback = local_prefill_fallback
        self.decode_stall_timeout_s = decode_stall_timeout_s
        self._block_size_set = False
        # base-class state used by stats() and _release() / _release_soon()
        self.counters: Counter[str] = Counter()
        self.streams_open = 0
        self._background: set[asyncio.Task] = set()

    def start(self) -> None:
        self.registry.start()

    async def ready(self) -> bool:
        """Serving is possible: at least one decode worker is up (prefill can fall back to local)."""
        return bool(self.registry.up(DECODE))

    def workers_view(self) -> dict:
        return {"policy": self.policy.name, "disaggregation": self.disagg.describe(), "workers": self.registry.snapshot()}

    def _sync_block_size(self) -> None:
        if self._block_size_set or not hasattr(self.policy, "block_size"):
            return
        for w in self.registry.all():
            if w.layout is not None:
                self.policy.block_size = w.layout.block_size
                self._block_size_set = True
                return

    def _pick(self, role: str, prompt: list[int], exclude: set[str]) -> WorkerState | None:
        candidates = [w for w in self.registry.up(role) if w.address not in exclude]
        if not candidates:
            return None
        w = self.policy.pick(role, candidates, prompt)
        w.picks += 1
        ROUTER_WORKER_PICKS.labels(role, w.address).inc()
        return w

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens. ``deadline``: absolute ``time.monotonic()`` time, or None."""
        self.counters["requests"] += 1
        self.streams_open += 1
        try:
            async with contextlib.aclosing(self._generate(request_id, prompt_token_ids, params, deadline)) as events:
                async for ev in events:
                    yield ev
        finally:
            self.streams_open -= 1

    def _retryable(self, exc: grpc.aio.AioRpcError, deadline: float | None) -> bool:
        return self._retryable_code(exc.code(), deadline)

    @staticmethod
    def _retryable_code(code: grpc.StatusCode, deadline: float | None) -> bool:
        left = time_left(deadline)
        return code in RETRYABLE and (left is None or left > 0)

    async def _generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float | None
    ) -> AsyncIterator[TokenEvent]:
        self._sync_block_size()
        if not await self.registry.wait_for(DECODE, self.wait_for_workers_s):
            raise WorkerUnavailable("no decode worker is up")
        if not self.registry.up(PREFILL) and self.disagg.mode == "always":
            await self.registry.wait_for(PREFILL, min(self.wait_for_workers_s, 1.0))
        sampling = sampling_to_proto(params)
        prompt = prompt_token_ids
        decode_tried: set[str] = set()
        decode = self._pick(DECODE, prompt, decode_tried)
        prefill_tried: set[str] = set()
        prefill = self._pick(PREFILL, prompt, prefill_tried)

        resp = None
        if prefill is None and not self.local_prefill_fallback and self.disagg.mode == "always":
            raise WorkerUnavailable("no prefill worker is up")
        if prefill is not None:
            uncached = len(prompt) - self.policy.matched_tokens(prefill, prompt)
            decision = self.disagg.decide(uncached, prefill.inflight_prefill_tokens, decode.running_requests)
            while not decision.local and prefill is not None:
                resp = await self._try_prefill(prefill, request_id, prompt, sampling, uncached, deadline)
                if resp is not None:
                    break
                prefill_tried.add(prefill.address)
                if len(prefill_tried) >= self.prefill_attempts:
                    break
                ROUTER_FAILOVERS.labels(PREFILL).inc()
                self.counters["prefill_retries"] += 1
                prefill = self._pick(PREFILL, prompt, prefill_tried)
            if resp is None and not decision.local:
                if not self.local_prefill_fallback:
                    raise WorkerUnavailable(f"no prefill worker succeeded ({','.join(sorted(prefill_tried)) or 'none up'})")
                ROUTER_FAILOVERS.labels("local_prefill").inc()
                self.counters["local_prefill_fallbacks"] += 1
                logger.warning("request %s: no prefill worker succeeded (%s); prefilling on the decode worker", request_id,
                               ",".join(sorted(prefill_tried)) or "none up")
        if resp is not None:
            finish = FINISH_FROM_PROTO[resp.finish_reason]
            if finish is not None or not resp.HasField("kv_handle"):
                yield TokenEvent([resp.first_token_id], finish or "stop", resp.cached_tokens)
                return
            DISAGG_DECISIONS.labels("remote_prefill").inc()
            req = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                           kv_handle=resp.kv_handle, first_token_id=resp.first_token_id)
        else:
            DISAGG_DECISIONS.labels("local_prefill").inc()
            req = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
        local = resp is None
        started = False
        try:
            if not local:  # inside the try: a client gone after the first token still releases the KV
                yield TokenEvent([resp.first_token_id], None, resp.cached_tokens)
            while True:
                t0 = time.monotonic()
                d = decode
                d.inflight_requests += 1
                call = d.stub.Decode(req, timeout=hop_timeout(deadline))
                try:
                    async for msg in stall_guard(call, self.decode_stall_timeout_s, f"decode worker {decode.address}"):
                        if not started and msg.kv_recomputed and not local:
                            # the decode worker could not pull the KV and recomputed it: free it on the prefill worker
                            self.counters["kv_recomputed"] += 1
                            self._release_soon(prefill, resp.kv_handle.transfer_id)
                        if not started:
                            started = True
                            dt = time.monotonic() - t0
                            if local:
                                self.disagg.observe_local_prefill(len(prompt) - msg.cached_tokens, dt)
                                self.policy.record(decode, prompt)
                            else:
                                self.disagg.observe_transfer(len(prompt), dt)
                        finish = FINISH_FROM_PROTO[msg.finish_reason]
                        if finish is not None:  # let the stream end by itself: a cancel here would race its OK status
                            await asyncio.wait([asyncio.ensure_future(call.code())], timeout=1.0)
                        yield TokenEvent(list(msg.token_ids), finish, msg.cached_tokens)
                    return
                except (grpc.aio.AioRpcError, StreamStalled) as exc:
                    if isinstance(exc, StreamStalled):  # silent for too long: as if the worker were unreachable
                        code, reason, err = grpc.StatusCode.UNAVAILABLE, "STALLED", exc
                        self.counters["decode_stalls"] += 1
                    else:
                        code, reason = exc.code(), exc.code().name
                        err = error_from_rpc(exc, f"decode worker {decode.address}")
                    if code in _DOWN:  # unreachable, hung, stalled or draining: out of rotation, even mid-stream
                        self.registry.mark_failed(decode, reason)
                    if started or not self._retryable_code(code, deadline):
                        raise err from (exc if err is not exc else None)
                    decode_tried.add(decode.address)
                    nxt = self._pick(DECODE, prompt, decode_tried) if len(decode_tried) < self.decode_attempts else None
                    if nxt is None:
                        raise err from (exc if err is not exc else None)
                    ROUTER_FAILOVERS.labels(DECODE).inc()
                    self.counters["decode_retries"] += 1
                    logger.warning("request %s: decode worker %s failed before streaming (%s); trying %s", request_id,
                                   decode.address, reason, nxt.address)
                    decode = nxt
                finally:
                    d.inflight_requests -= 1
                    if not call.done():
                        call.cancel()
        finally:
            if not started and resp is not None and resp.HasField("kv_handle"):
                self._release_soon(prefill, resp.kv_handle.transfer_id)  # in the background: survives our cancellation

    async def _try_prefill(self, w: WorkerState, request_id: str, prompt: list[int], sampling, uncached: int,
                           deadline: float | None = None):
        """The PrefillResponse, or None after a retryable failure (raises a typed error for the others)."""
        w.inflight_requests += 1
        w.inflight_prefill_tokens += uncached
        t0 = time.monotonic()
        try:
            resp = await w.stub.Prefill(
                prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling),
                timeout=hop_timeout(deadline, self.prefill_timeout_s),
            )
        except grpc.aio.AioRpcError as exc:
            if not self._retryable(exc, deadline):
                raise error_from_rpc(exc, f"prefill worker {w.address}") from exc
            if exc.code() in _DOWN:
                self.registry.mark_failed(w, exc.code().name)
            logger.warning("request %s: prefill worker %s failed: %s", request_id, w.address, exc.code().name)
            return None
        finally:
            w.inflight_requests -= 1
            w.inflight_prefill_tokens -= uncached
        self.disagg.observe_remote_prefill(len(prompt) - resp.cached_tokens, time.monotonic() - t0)
        self.policy.record(w, prompt)
        return resp

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=5)
        await self.registry.close()
