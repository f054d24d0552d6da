"""The prefill leg of a routed request: where the prompt is prefilled, and the prefill itself.

1. Pick a prefill worker with the routing policy (among workers up now). None up: prefill locally on the decode
   worker, unless local prefill is off and every request must be prefilled remotely (``--disagg always``):
   then the request fails with WorkerUnavailable.
2. Conditional disaggregation decides local or remote prefill from the *uncached* prompt tokens (prompt tokens
   minus those the policy expects the worker's prefix cache to hold) and the load of both workers.
3. Remote: ``Prefill`` on the worker. A failure before the first token (UNAVAILABLE, deadline, overload,
   internal) moves the request to another prefill worker (at most ``prefill_attempts`` workers in all), then to
   local prefill on the decode worker (``local_prefill_fallback``; off: WorkerUnavailable). Other failures
   (invalid request, KV layout mismatch) end the request with their typed error.

The result is a :class:`RemotePrefill` (the worker holds the prompt's KV for the decode leg under a lease, named
by ``response.kv_handle``), or None when the decode worker prefills the prompt itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from pd.v1 import common_pb2, prefill_pb2

from splitserve.deadline import hop_timeout
from splitserve.errors import WorkerUnavailable
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import FINISH_FROM_PROTO
from splitserve.rpc.status import error_from_rpc
from splitserve.services.router.registry import PREFILL, WorkerState
from splitserve.services.router.retry import DOWN, retryable
from splitserve.telemetry.metrics import ROUTER_FAILOVERS

if TYPE_CHECKING:
    from splitserve.services.router.backend import RoutedBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A prompt prefilled on ``worker``: ``response`` holds the first token and, unless prefill alone finished the
    request, the ``kv_handle`` the decode worker pulls the KV blocks with."""

    worker: WorkerState
    response: prefill_pb2.PrefillResponse

    def final_event(self) -> TokenEvent | None:
        """The request's one and only event when prefill alone finished it (the first token was EOS, a stop token
        or the last of ``max_tokens``; no KV handle), else None."""
        finish = FINISH_FROM_PROTO[self.response.finish_reason]
        if finish is None and self.response.HasField("kv_handle"):
            return None
        return TokenEvent([self.response.first_token_id], finish or "stop", self.response.cached_tokens)


async def prefill_leg(router: RoutedBackend, request_id: str, prompt: list[int], sampling: common_pb2.SamplingParams,
                      decode: WorkerState, deadline: float | None) -> RemotePrefill | None:
    """Prefill ``prompt`` (token ids) for the decode worker ``decode`` (see the module docstring).

    Returns:
        The remote prefill, or None: the decode worker prefills locally.

    Raises:
        WorkerUnavailable: no prefill worker is up or none succeeded, and the request may not be prefilled locally.
        PdError: the typed error of a prefill worker's non-retryable failure (e.g. InvalidRequest, KVLayoutMismatch).
    """
    tried: set[str] = set()
    prefill = router.pick(PREFILL, prompt, tried)
    if prefill is None:
        if not router.local_prefill_fallback and router.disagg.mode == "always":
            raise WorkerUnavailable("no prefill worker is up")
        return None
    uncached = len(prompt) - router.policy.matched_tokens(prefill, prompt)
    if router.disagg.decide(uncached, prefill.inflight_prefill_tokens, decode.running_requests).local:
        return None
    while prefill is not None:
        resp = await _try_prefill(router, prefill, request_id, prompt, sampling, uncached, deadline)
        if resp is not None:
            return RemotePrefill(prefill, resp)
        tried.add(prefill.address)
        if len(tried) >= router.prefill_attempts:
            break
        ROUTER_FAILOVERS.labels(PREFILL).inc()
        router.counters["prefill_retries"] += 1
        prefill = router.pick(PREFILL, prompt, tried)
    names = ",".join(sorted(tried)) or "none up"
    if not router.local_prefill_fallback:
        raise WorkerUnavailable(f"no prefill worker succeeded ({names})")
    ROUTER_FAILOVERS.labels("local_prefill").inc()
    router.counters["local_prefill_fallbacks"] += 1
    logger.warning("request %s: no prefill worker succeeded (%s); prefilling on the decode worker", request_id, names)
    return None


async def _try_prefill(router: RoutedBackend, w: WorkerState, request_id: str, prompt: list[int],
                       sampling: common_pb2.SamplingParams, uncached: int,
                       deadline: float | None) -> prefill_pb2.PrefillResponse | None:
    """One Prefill call on ``w``: its response, or None after a retryable failure (a worker that is unreachable
    leaves the rotation). Raises the typed error of any other failure. ``uncached`` (tokens) counts towards the
    worker's queued prefill tokens while the call runs."""
    w.inflight_requests += 1
    w.inflight_prefill_tokens += uncached
    t0 = time.monotonic()
    try:
        resp = await w.stub.Prefill(
            prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling),
            timeout=hop_timeout(deadline, router.prefill_timeout_s),
        )
    except grpc.aio.AioRpcError as exc:
        if not retryable(exc.code(), deadline):
            raise error_from_rpc(exc, f"prefill worker {w.address}") from exc
        if exc.code() in DOWN:
            router.registry.mark_failed(w, exc.code().name)
        logger.warning("request %s: prefill worker %s failed: %s", request_id, w.address, exc.code().name)
        return None
    finally:
        w.inflight_requests -= 1
        w.inflight_prefill_tokens -= uncached
    router.disagg.observe_remote_prefill(len(prompt) - resp.cached_tokens, time.monotonic() - t0)
    router.policy.record(w, prompt)
    return resp
