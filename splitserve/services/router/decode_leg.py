"""The decode leg of a routed request: stream the tokens from a decode worker.

1. The DecodeRequest carries the prefill's KV handle and the first token of every choice (remote prefill; those
   tokens, one event per choice, are sent to the client at once), or neither (local prefill: the decode worker
   prefills the prompt itself, and its stream starts with the first tokens and the prompt's logprobs).
2. A decode worker that fails before its stream starts (UNAVAILABLE, deadline, overload, internal) is left for
   another one (at most ``decode_attempts`` workers in all); the KV handle stays valid meanwhile (the prefill
   worker holds the KV on a lease). An unreachable worker also leaves the rotation.
3. Once tokens flow, a failure the router may retry (the worker died, stalled or fails) moves the unfinished choices
   to other decode workers, each continuing from the tokens already sent (:mod:`~splitserve.services.router.migration`,
   at most ``decode_migrations`` moves per choice); otherwise the request ends with its typed error (an SSE error
   event / a gRPC status at the front doors), never a hang. Push mode: a decode worker failing after the push
   completed but before its stream started is not retried with the same request (the KV is only on that worker, and
   the prefill worker freed its copy); the client already has every choice's first token, so the unfinished choices
   migrate as in a mid-stream failure (the new worker recomputes prompt + first token).
4. Stall guard: a stream that sends nothing for ``decode_stall_timeout_s`` fails as UNAVAILABLE
   (:mod:`~splitserve.services.router.stall`) and its worker leaves the rotation, before or after the first token.
5. Release on exit: when no decode stream started (all failed, the client left, the deadline passed), or the decode
   worker recomputed the prompt instead of pulling the KV (``kv_recomputed``), the prefill worker is told to free
   the KV at once (:mod:`~splitserve.services.router.kv_release`) instead of holding it until the lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from splitserve.services.router.prompt_blocks import PromptBlocks
from splitserve.services.router.registry import DECODE, WorkerState
from splitserve.services.router.retry import DOWN, retryable
from splitserve.services.router.migration import continue_choices
from splitserve.services.router.stall import stall_guard
from splitserve.telemetry.metrics import DISAGG_DECISIONS, ROUTER_FAILOVERS

if TYPE_CHECKING:
    from splitserve.services.router.backend import RoutedBackend
    from splitserve.services.router.disaggregation import QueuedPrefill

logger = logging.getLogger(__name__)

_FINISH_WAIT_S = 1.0  # how long the last message waits for the stream's own end (its OK status)


class DecodeLeg:
    """The decode leg of one request (see the module docstring).

    Args:
        router: the backend (registry, policy, disaggregation, counters, settings).
        request_id: the request's id, the same on every leg.
        prompt: the prompt's token ids (with its block hashes, computed once per request).
        sampling: the request's sampling parameters.
        decode: the decode worker picked first.
        remote: the prefill leg's result; None: the decode worker prefills locally.
        deadline: absolute ``time.monotonic()`` seconds, or None.
        resume: a migration's continuation (:mod:`~splitserve.services.router.migration`): ``(choice index, the
            tokens that choice already generated)``; ``sampling`` is then that choice's alone.
        migrations: how many times this choice's stream already moved (a continuation's count).
        tried: workers that already failed this request (never picked again).
        call: push mode: the Decode stream already running for a pushed KV (:mod:`.push_leg`); it is not retried on
            another worker (the KV is only on this one): its failure before streaming migrates the choices (step 3).

    Attributes:
        started: a decode stream sent its first message (from then on a failure is not retried; it may migrate).
        generated: per choice index, the tokens passed on so far (a continuation's history first).
    """

    def __init__(self, router: RoutedBackend, request_id: str, prompt: PromptBlocks | list[int], sampling: common_pb2.SamplingParams,
                 decode: WorkerState, remote: RemotePrefill | None, deadline: float | None, *,
                 resume: tuple[int, list[int]] | None = None, migrations: int = 0, tried: set[str] = frozenset(),
                 call: grpc.aio.UnaryStreamCall | None = None) -> None:
        self.router = router
        self.request_id = request_id
        self.prompt = prompt = PromptBlocks.of(prompt)
        self.sampling = sampling
        self.decode = decode
        self.remote = remote
        self.deadline = deadline
        self.tried: set[str] = set(tried)
        self.attempts = 0  # decode workers this leg called
        self.started = False
        self.local_call: QueuedPrefill | None = None  # a local prefill in the cost model's queue, until its first token
        self.migrations = migrations
        self.logprobs = sampling.HasField("logprobs")
        self.choice = None if resume is None else resume[0]  # a continuation's stream (index 0) is this choice
        self.generated: dict[int, list[int]] = {} if resume is None else {resume[0]: list(resume[1])}
        self.open_choices = set(range(sampling.n or 1)) if resume is None else {resume[0]}  # without a finish_reason yet
        self.pushed_call = call
        self.retry = call is None  # a pushed KV is only on the first decode worker
        if resume is not None:
            self.request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt.token_ids,
                                                    sampling=sampling, resume_output_token_ids=resume[1])
        elif remote is None or call is not None:
            self.request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt.token_ids,
                                                    sampling=sampling)
        else:
            first = remote.first_token_ids
            self.request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt.token_ids,
                                                    sampling=sampling, kv_handle=remote.response.kv_handle, first_token_id=first[0],
                                                    first_token_ids=first)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The request's tokens: the prefill's first token of each choice (remote prefill), then the decode stream's.
        Events of a choice that already finished (at prefill) are dropped.

        Raises:
            PdError: the typed error of a failure that was not (or could no longer be) moved to another worker.
        """
        remote = self.remote
        if self.choice is None:
            DISAGG_DECISIONS.labels("local_prefill" if remote is None else "remote_prefill").inc()
            if remote is None and self.pushed_call is None:  # a local prefill: it queues on the decode worker
                uncached = len(self.prompt) - self.router.policy.matched_tokens(self.decode, self.prompt)
                self.local_call = self.router.disagg.local_started(self.decode.address, uncached)
        try:
            if remote is not None:  # inside the try: a client gone after the first token still releases the KV
                for ev in remote.first_events():
                    if ev.finish_reason is not None:
                        self.open_choices.discard(ev.index)
                    self.generated.setdefault(ev.index, []).extend(ev.token_ids)
                    yield ev
            while True:
                w = self.decode
                w.inflight_requests += 1
                self.attempts += 1
                call, self.pushed_call = self.pushed_call or w.stub.Decode(self.request, timeout=hop_timeout(self.deadline)), None
                try:
                    async for msg in stall_guard(call, self.router.decode_stall_timeout_s, f"decode worker {w.address}"):
                        if not self.started:
                            self._first_message(msg)
                        ev = await self._event(call, msg)
                        if ev is not None:
                            if ev.finish_reason is not None and ev.index == (self.choice or 0):
                                self._record_held()  # before the yield: a consumer may stop at the finish event
                            yield ev
                    return
                except (grpc.aio.AioRpcError, StreamStalled) as exc:
                    nxt = self._next_worker(exc)  # raises when the request cannot move
                    if nxt is None:  # mid-stream: the unfinished choices continue elsewhere
                        err, _, reason = self._failure(exc)
                        break
                    self.decode = nxt
                finally:
                    w.inflight_requests -= 1
                    if not call.done():
                        call.cancel()
        finally:
            if self.local_call is not None:  # no first token from it (failed, moved or cancelled): no sample
                self.router.disagg.local_finished(self.local_call, None)
                self.local_call = None
            if remote is not None and not self.started and remote.response.HasField("kv_handle"):
                self.router.kv_release.soon(remote.worker, remote.response.kv_handle.transfer_id)  # survives our cancel
        if self.open_choices:
            async with contextlib.aclosing(continue_choices(self, err, reason)) as events:
                async for ev in events:
                    yield ev

    def _record_held(self) -> None:
        """Tell the policy what the decode worker's prefix cache now holds: the prompt and every token choice 0 (a
        continuation: its choice) generated but the last (the last one's KV is never computed), so the next turn of a
        chat, whose prompt extends them, can reuse them there (or skip the prefill worker)."""
        held = self.generated.get(self.choice or 0, [])
        self.router.policy.record(self.decode, self.prompt.extended(held[:-1]))

    def _first_message(self, msg: decode_pb2.DecodeResponse) -> None:
        """The stream started: free KV the decode worker recomputed instead of pulling, and feed the disaggregation
        cost model (the local prefill's first token, or the KV pull time the decode worker reports)."""
        self.started = True
        router, remote = self.router, self.remote
        if self.choice is not None:  # a continuation: no prefill decision to learn from
            return
        if remote is None:
            if self.local_call is not None:
                router.disagg.local_finished(self.local_call, len(self.prompt) - msg.cached_tokens)
                self.local_call = None
            router.policy.record(self.decode, self.prompt)
            return
        router.policy.record(self.decode, self.prompt)  # the decode worker's prefix cache now holds the prompt
        if msg.kv_recomputed or msg.kv_not_pulled:
            router.counters["kv_recomputed" if msg.kv_recomputed else "kv_not_pulled"] += 1
            router.kv_release.soon(remote.worker, remote.response.kv_handle.transfer_id)
        if msg.HasField("kv_transfer_us"):  # the decode worker pulled the KV: how long the handoff took
            router.disagg.observe_transfer(len(self.prompt), msg.kv_transfer_us / 1e6)

    async def _event(self, call: grpc.aio.UnaryStreamCall, msg: decode_pb2.DecodeResponse) -> TokenEvent | None:
        """``msg`` as a TokenEvent (its tokens recorded in ``generated``); None for a choice that has already finished.
        A continuation's events carry its choice's index and no cached_tokens (the request's usage was counted)."""
        index = msg.index if self.choice is None else self.choice
        if index not in self.open_choices:
            return None
        finish = FINISH_FROM_PROTO[msg.finish_reason]
        if finish is not None:
            self.open_choices.discard(index)
            if not self.open_choices:  # the last choice: let the stream end by itself (a cancel would race its OK)
                await asyncio.wait([asyncio.ensure_future(call.code())], timeout=_FINISH_WAIT_S)
        prompt = prompt_logprobs_from_proto(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None
        self.generated.setdefault(index, []).extend(msg.token_ids)
        return TokenEvent(list(msg.token_ids), finish, msg.cached_tokens if self.choice is None else 0, index=index,
                          logprobs=logprobs_from_proto(msg.logprobs, self.logprobs), prompt_logprobs=prompt)

    def _failure(self, exc: grpc.aio.AioRpcError | StreamStalled) -> tuple[PdError, grpc.StatusCode, str]:
        """(typed error, status code, reason) of a failed decode call; ``exc`` itself for a stall."""
        if isinstance(exc, StreamStalled):  # silent for too long: as if the worker were unreachable
            return exc, grpc.StatusCode.UNAVAILABLE, "STALLED"
        return error_from_rpc(exc, f"decode worker {self.decode.address}"), exc.code(), exc.code().name

    def _next_worker(self, exc: grpc.aio.AioRpcError | StreamStalled) -> WorkerState | None:
        """The decode worker to try after ``exc`` on the current one (an unreachable or stalled worker leaves the
        rotation first); None when the stream had started and its unfinished choices may migrate (a retryable
        failure, time left, fewer than ``decode_migrations`` moves so far; every choice finished: nothing to move).
        Raises ``exc`` as a typed error when the request cannot move: the failure is not retryable, the stream had
        started and may not migrate, ``decode_attempts`` are used up, or no other worker is up."""
        router, w = self.router, self.decode
        err, code, reason = self._failure(exc)
        if isinstance(exc, StreamStalled):
            router.counters["decode_stalls"] += 1
        if code in DOWN:  # unreachable, hung, stalled or draining: out of rotation, even mid-stream
            router.registry.mark_failed(w, reason)
        self.tried.add(w.address)
        if not self.started and not self.retry:  # push: the KV was only on this worker; the first tokens were sent
            if self.open_choices and retryable(code, self.deadline) and self.migrations < router.decode_migrations:
                return None  # the unfinished choices continue elsewhere from their first tokens
            _raise(err, exc)
        if self.started and not self.open_choices:  # the failure came after every choice's last token
            return None
        if not retryable(code, self.deadline) or (self.started and self.migrations >= router.decode_migrations):
            _raise(err, exc)
        if self.started:
            return None
        nxt = router.pick(DECODE, self.prompt, self.tried) if self.attempts < router.decode_attempts else None
        if nxt is None:
            _raise(err, exc)
        ROUTER_FAILOVERS.labels(DECODE).inc()
        router.counters["decode_retries"] += 1
        logger.warning("request %s: decode worker %s failed before streaming (%s); trying %s", self.request_id,
                       w.address, reason, nxt.address)
        return nxt


def _raise(err: PdError, exc: BaseException) -> NoReturn:
    raise err from (exc if err is not exc else None)
