"""The decode leg of a routed request: stream the tokens from a decode worker.

1. The DecodeRequest carries the prefill's KV handle and the first token of every choice (remote prefill; those
   tokens, one event per choice, are sent to the client at once), or neither (local prefill: the decode worker
   prefills the prompt itself, and its stream starts with the first tokens and the prompt's logprobs).
2. A decode worker that fails before its stream starts (UNAVAILABLE, deadline, overload, internal) is left for
   another one (at most ``decode_attempts`` workers in all); the KV handle stays valid meanwhile (the prefill
   worker holds the KV on a lease). An unreachable worker also leaves the rotation.
3. Once tokens flow, a failure ends the request with its typed error (an SSE error event / a gRPC status at the
   front doors), never a hang, and is not retried (tokens were already sent).
4. Stall guard: a stream that sends nothing for ``decode_stall_timeout_s`` fails as UNAVAILABLE
   (:mod:`~splitserve.services.router.stall`) and its worker leaves the rotation, before or after the first token.
5. Release on exit: when no decode stream started (all failed, the client left, the deadline passed), or the decode
   worker recomputed the prompt instead of pulling the KV (``kv_recomputed``), the prefill worker is told to free
   the KV at once (:mod:`~splitserve.services.router.kv_release`) instead of holding it until the lease ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NoReturn

import grpc
from pd.v1 import common_pb2, decode_pb2

from splitserve.deadline import hop_timeout
from splitserve.errors import PdError, StreamStalled
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import FINISH_FROM_PROTO, logprobs_from_proto, prompt_logprobs_from_proto
from splitserve.rpc.status import error_from_rpc
from splitserve.services.router.prefill_leg import RemotePrefill
from splitserve.services.router.registry import DECODE, WorkerState
from splitserve.services.router.retry import DOWN, retryable
from splitserve.services.router.stall import stall_guard
from splitserve.telemetry.metrics import DISAGG_DECISIONS, ROUTER_FAILOVERS

if TYPE_CHECKING:
    from splitserve.services.router.backend import RoutedBackend

logger = logging.getLogger(__name__)

_FINISH_WAIT_S = 1.0  # how long the last message waits for the stream's own end (its OK status)


class DecodeLeg:
    """The decode leg of one request (see the module docstring).

    Args:
        router: the backend (registry, policy, disaggregation, counters, settings).
        request_id: the request's id, the same on every leg.
        prompt: the prompt's token ids.
        sampling: the request's sampling parameters.
        decode: the decode worker picked first.
        remote: the prefill leg's result; None: the decode worker prefills locally.
        deadline: absolute ``time.monotonic()`` seconds, or None.
        call: push mode: the Decode stream already running for a pushed KV (:mod:`.push_leg`); it is not retried on
            another worker (the KV is only on this one).

    Attributes:
        started: a decode stream sent its first message (from then on a failure is not retried).
    """

    def __init__(self, router: RoutedBackend, request_id: str, prompt: list[int], sampling: common_pb2.SamplingParams,
                 decode: WorkerState, remote: RemotePrefill | None, deadline: float | None,
                 call: grpc.aio.UnaryStreamCall | None = None) -> None:
        self.router = router
        self.request_id = request_id
        self.prompt = prompt
        self.decode = decode
        self.remote = remote
        self.deadline = deadline
        self.tried: set[str] = set()
        self.started = False
        self.logprobs = sampling.HasField("logprobs")
        self.open_choices = set(range(sampling.n or 1))  # choices without a finish_reason yet
        self.pushed_call = call
        self.retry = call is None  # a pushed KV is only on the first decode worker
        if remote is None or call is not None:
            self.request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
        else:
            first = remote.first_token_ids
            self.request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                                    kv_handle=remote.response.kv_handle, first_token_id=first[0],
                                                    first_token_ids=first)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The request's tokens: the prefill's first token of each choice (remote prefill), then the decode stream's.
        Events of a choice that already finished (at prefill) are dropped.

        Raises:
            PdError: the typed error of a failure that was not (or could no longer be) moved to another worker.
        """
        remote = self.remote
        DISAGG_DECISIONS.labels("local_prefill" if remote is None else "remote_prefill").inc()
        try:
            if remote is not None:  # inside the try: a client gone after the first token still releases the KV
                for ev in remote.first_events():
                    if ev.finish_reason is not None:
                        self.open_choices.discard(ev.index)
                    yield ev
            while True:
                w = self.decode
                w.inflight_requests += 1
                t0 = time.monotonic()
                call, self.pushed_call = self.pushed_call or w.stub.Decode(self.request, timeout=hop_timeout(self.deadline)), None
                try:
                    async for msg in stall_guard(call, self.router.decode_stall_timeout_s, f"decode worker {w.address}"):
                        if not self.started:
                            self._first_message(msg, time.monotonic() - t0)
                        ev = await self._event(call, msg)
                        if ev is not None:
                            yield ev
                    return
                except (grpc.aio.AioRpcError, StreamStalled) as exc:
                    self.decode = self._next_worker(exc)  # raises when the request cannot move
                finally:
                    w.inflight_requests -= 1
                    if not call.done():
                        call.cancel()
        finally:
            if remote is not None and not self.started and remote.response.HasField("kv_handle"):
                self.router.kv_release.soon(remote.worker, remote.response.kv_handle.transfer_id)  # survives our cancel

    def _first_message(self, msg: decode_pb2.DecodeResponse, seconds: float) -> None:
        """The stream started: free KV the decode worker recomputed instead of pulling, and feed the disaggregation
        cost model (``seconds`` from the Decode call to this message)."""
        self.started = True
        router, remote = self.router, self.remote
        if remote is None:
            router.disagg.observe_local_prefill(len(self.prompt) - msg.cached_tokens, seconds)
            router.policy.record(self.decode, self.prompt)
            return
        if msg.kv_recomputed:
            router.counters["kv_recomputed"] += 1
            router.kv_release.soon(remote.worker, remote.response.kv_handle.transfer_id)
        router.disagg.observe_transfer(len(self.prompt), seconds)

    async def _event(self, call: grpc.aio.UnaryStreamCall, msg: decode_pb2.DecodeResponse) -> TokenEvent | None:
        """``msg`` as a TokenEvent; None for a choice that has already finished."""
        if msg.index not in self.open_choices:
            return None
        finish = FINISH_FROM_PROTO[msg.finish_reason]
        if finish is not None:
            self.open_choices.discard(msg.index)
            if not self.open_choices:  # the last choice: let the stream end by itself (a cancel would race its OK)
                await asyncio.wait([asyncio.ensure_future(call.code())], timeout=_FINISH_WAIT_S)
        prompt = prompt_logprobs_from_proto(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None
        return TokenEvent(list(msg.token_ids), finish, msg.cached_tokens, index=msg.index,
                          logprobs=logprobs_from_proto(msg.logprobs, self.logprobs), prompt_logprobs=prompt)

    def _next_worker(self, exc: grpc.aio.AioRpcError | StreamStalled) -> WorkerState:
        """The decode worker to try after ``exc`` on the current one (an unreachable or stalled worker leaves the
        rotation first). Raises ``exc`` as a typed error when the request cannot move: its stream had started, the
        failure is not retryable, ``decode_attempts`` are used up, or no other worker is up."""
        router, w = self.router, self.decode
        if isinstance(exc, StreamStalled):  # silent for too long: as if the worker were unreachable
            code, reason, err = grpc.StatusCode.UNAVAILABLE, "STALLED", exc
            router.counters["decode_stalls"] += 1
        else:
            code, reason = exc.code(), exc.code().name
            err = error_from_rpc(exc, f"decode worker {w.address}")
        if code in DOWN:  # unreachable, hung, stalled or draining: out of rotation, even mid-stream
            router.registry.mark_failed(w, reason)
        if self.started or not retryable(code, self.deadline) or not self.retry:
            _raise(err, exc)
        self.tried.add(w.address)
        nxt = router.pick(DECODE, self.prompt, self.tried) if len(self.tried) < router.decode_attempts else None
        if nxt is None:
            _raise(err, exc)
        ROUTER_FAILOVERS.labels(DECODE).inc()
        router.counters["decode_retries"] += 1
        logger.warning("request %s: decode worker %s failed before streaming (%s); trying %s", self.request_id,
                       w.address, reason, nxt.address)
        return nxt


def _raise(err: PdError, exc: BaseException) -> NoReturn:
    raise err from (exc if err is not exc else None)
