"""The prefill leg of a routed request: where the prompt is prefilled, and the prefill itself.

1. Pick a prefill worker with the routing policy (among workers up now). None up: prefill locally on the decode
   worker, unless local prefill is off and every request must be prefilled remotely (``--disagg always``):
   then the request fails with WorkerUnavailable.
2. Prefill skip: when the policy believes the decode worker's prefix cache holds all but at most
   ``skip_prefill_tokens`` of the prompt, the decode worker prefills it (computing only the uncached tail).
   Otherwise conditional disaggregation decides local or remote prefill from the *uncached* prompt tokens (prompt
   tokens minus those the policy expects the worker's prefix cache to hold) and the load of both workers.
3. Remote: ``Prefill`` on the worker. A failure before the first token (UNAVAILABLE, deadline, overload,
   internal) moves the request to another prefill worker (at most ``prefill_attempts`` workers in all), then to
   local prefill on the decode worker (``local_prefill_fallback``; off: WorkerUnavailable). Other failures
   (invalid request, KV layout mismatch) end the request with their typed error.

The result is a :class:`RemotePrefill` (the worker holds the prompt's KV for the decode leg under a lease, named
by ``response.kv_handle``, and has sampled the first token of each of the request's n choices), or None when the
decode worker prefills the prompt itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from pd.v1 import common_pb2, prefill_pb2

from splitserve.deadline import hop_timeout
from splitserve.errors import WorkerUnavailable
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import FINISH_FROM_PROTO, logprob_from_proto, prompt_logprobs_from_proto
from splitserve.rpc.status import error_from_rpc
from splitserve.services.router.prompt_blocks import PromptBlocks
from splitserve.services.router.registry import PREFILL, WorkerState
from splitserve.services.router.retry import DOWN, retryable
from splitserve.telemetry.metrics import ROUTER_FAILOVERS

if TYPE_CHECKING:
    from splitserve.services.router.backend import RoutedBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A prompt prefilled on ``worker``: ``response`` holds the first token of every choice and, unless prefill alone
    finished the request, the ``kv_handle`` the decode worker pulls the KV blocks with."""

    worker: WorkerState
    response: prefill_pb2.PrefillResponse

    @property
    def first_token_ids(self) -> list[int]:
        """Choice i's first token at index i (a worker that predates n sends only ``first_token_id``)."""
        return list(self.response.first_token_ids) or [self.response.first_token_id]

    @property
    def finished(self) -> bool:
        """Prefill alone finished the request (every choice's first token was EOS, a stop token or the last of
        ``max_tokens``): no KV handle (nor a pushed KV), no decode leg."""
        r = self.response
        return FINISH_FROM_PROTO[r.finish_reason] is not None or not (r.HasField("kv_handle") or r.kv_pushed)

    def finish_reasons(self) -> list[str | None]:
        """Per choice: the finish reason of a choice that ended with its first token, else None. When the request
        finished at prefill every choice has one (a missing one reads as the request's, or "stop")."""
        r = self.response
        n = len(self.first_token_ids)
        reasons = [FINISH_FROM_PROTO[f] for f in r.finish_reasons] if len(r.finish_reasons) == n else [None] * n
        if self.finished:
            overall = FINISH_FROM_PROTO[r.finish_reason] or "stop"
            reasons = [f or overall for f in reasons]
        return reasons

    def first_events(self) -> list[TokenEvent]:
        """One event per choice, in choice order: its first token (``index`` i), that token's logprob when asked,
        the choice's finish reason when it ended there; the prompt's logprobs (when asked) on the first event."""
        r = self.response
        lps = [logprob_from_proto(m) for m in r.first_logprobs]
        prompt = prompt_logprobs_from_proto(r.prompt_logprobs) if r.HasField("prompt_logprobs") else None
        events = []
        for i, (tok, finish) in enumerate(zip(self.first_token_ids, self.finish_reasons())):
            events.append(TokenEvent([tok], finish, r.cached_tokens, index=i, logprobs=[lps[i]] if i < len(lps) else None,
                                     prompt_logprobs=prompt if i == 0 else None))
        return events


async def prefill_leg(router: RoutedBackend, request_id: str, prompt: PromptBlocks | list[int], sampling: common_pb2.SamplingParams,
                      decode: WorkerState, deadline: float | None) -> RemotePrefill | None:
    """Prefill ``prompt`` (token ids) for the decode worker ``decode`` (see the module docstring).

    Returns:
        The remote prefill, or None: the decode worker prefills locally.

    Raises:
        WorkerUnavailable: no prefill worker is up or none succeeded, and the request may not be prefilled locally.
        PdError: the typed error of a prefill worker's non-retryable failure (e.g. InvalidRequest, KVLayoutMismatch).
    """
    prompt = PromptBlocks.of(prompt)
    tried: set[str] = set()
    prefill = router.pick(PREFILL, prompt, tried)
    if prefill is None:
        if not router.local_prefill_fallback and router.disagg.mode == "always":
            raise WorkerUnavailable("no prefill worker is up")
        return None
    held = router.policy.matched_tokens(decode, prompt)
    if router.skip_prefill_tokens and held and len(prompt) - held <= router.skip_prefill_tokens:
        router.counters["prefill_skipped"] += 1
        return None
    uncached = len(prompt) - router.policy.matched_tokens(prefill, prompt)
    disagg = router.disagg
    if disagg.decide(uncached, disagg.prefill_queue.wait_s(prefill.address), decode.running_requests,
                     disagg.local_queue.wait_s(decode.address)).local:
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


async def _try_prefill(router: RoutedBackend, w: WorkerState, request_id: str, prompt: PromptBlocks,
                       sampling: common_pb2.SamplingParams, uncached: int,
                       deadline: float | None, push_bootstrap_id: str = "") -> prefill_pb2.PrefillResponse | None:
    """One Prefill call on ``w``: its response, or None after a retryable failure (a worker that is unreachable
    leaves the rotation). Raises the typed error of any other failure. ``uncached`` (tokens) counts towards the
    worker's queued prefill tokens while the call runs. ``push_bootstrap_id``: push the KV (:mod:`.push_leg`)."""
    w.inflight_requests += 1
    w.inflight_prefill_tokens += uncached
    call = router.disagg.remote_started(w.address, uncached)
    done: int | None = None  # uncached tokens prefilled (the cost model's sample), once the call succeeded
    try:
        resp = await w.stub.Prefill(
            prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt.token_ids, sampling=sampling,
                                       push_bootstrap_id=push_bootstrap_id),
            timeout=hop_timeout(deadline, router.prefill_timeout_s),
        )
    except grpc.aio.AioRpcError as exc:
        if not retryable(exc.code(), deadline):
            raise error_from_rpc(exc, f"prefill worker {w.address}") from exc
        if exc.code() in DOWN:
            router.registry.mark_failed(w, exc.code().name)
        logger.warning("request %s: prefill worker %s failed: %s", request_id, w.address, exc.code().name)
        return None
    else:
        done = len(prompt) - resp.cached_tokens
    finally:
        w.inflight_requests -= 1
        w.inflight_prefill_tokens -= uncached
        router.disagg.remote_finished(call, done)
    router.policy.record(w, prompt)
    return resp
