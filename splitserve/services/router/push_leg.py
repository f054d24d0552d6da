"""The push leg of a routed request (``--kv-transfer-mode push``): prefill and decode dispatched at once.

1. Pick a prefill worker whose KV sender endpoint the registry knows (the worker's own advertised endpoint, never
   the client's) and make a random bootstrap id.
2. Start the Decode call (the decode worker reserves the prompt's blocks and subscribes under the id on that
   sender) and the Prefill call (the prefill worker writes each layer's KV into those blocks as it is computed,
   then the first tokens) together.
3. The Prefill response decides:
   * ``kv_pushed``: the decode stream (already running) carries the tokens after the first: the caller streams it.
   * finished at prefill (every choice ended with its first token): the decode worker frees its blocks and ends
     its stream empty.

A Decode call the request no longer needs is drained in the background and cancelled after ``DRAIN_S`` at most:
cancelling it at once could abandon UCX receives the prefill worker is about to complete (costing the
connection).
   * a ``kv_handle`` instead (the push could not complete, e.g. no subscription in time): the decode call is
     left to end by itself (the prefill worker failed its subscription: it frees its blocks) and the caller
     pulls, as in direct mode.
   * a failure: the decode call is left to end by itself (the prefill worker sent a failure, or its connection
     broke). A non-retryable failure (invalid request) ends the request; a
     retryable one (worker unreachable, overloaded, deadline of the hop) falls back to the ordinary prefill leg
     (another prefill worker, or a local prefill on the decode worker).

A dropped Decode call may still be open on the decode worker when the request goes on (the pull path, or a local
prefill on the same worker), so the rest of the request runs under another request id (:func:`pull_request_id`):
the decode worker refuses a request id it is already serving.

The result is a :class:`PushStart`, or None when the request should take the ordinary (pull) path: also when the
decode worker is believed to hold a prefix of the prompt (the prefix_aware policy's record), since a push fills every
prompt block while the pull path moves only the uncached suffix or skips the prefill worker.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from pd.v1 import common_pb2, decode_pb2

from splitserve.deadline import hop_timeout
from splitserve.services.router.migration import suffixed_id
from splitserve.services.router.prefill_leg import RemotePrefill, _try_prefill
from splitserve.services.router.prompt_blocks import PromptBlocks
from splitserve.services.router.registry import PREFILL, WorkerState

if TYPE_CHECKING:
    from splitserve.services.router.backend import RoutedBackend

logger = logging.getLogger(__name__)

DRAIN_S = 5.0  # how long an unneeded Decode call may take to end by itself before it is cancelled
_draining: set[asyncio.Task] = set()


@dataclass(slots=True)
class PushStart:
    """The push leg's outcome: ``remote``, the prefill's response (None: the prefill failed, take the ordinary prefill
    leg); ``call``, the Decode stream already running when the KV was pushed (None when it was dropped: the request
    finished at prefill, or the KV is to be pulled); ``request_id``, the id every later leg uses (the request's own
    while ``call`` is kept, :func:`pull_request_id` once the dispatched Decode call was dropped)."""

    remote: RemotePrefill | None
    call: grpc.aio.UnaryStreamCall | None
    request_id: str


def pull_request_id(request_id: str) -> str:
    """The id of a request's later legs after its push Decode call was dropped (unique on the decode worker while
    that call drains; the base stays readable in logs)."""
    return suffixed_id(request_id, "~pull")


async def push_leg(router: RoutedBackend, request_id: str, prompt: PromptBlocks | list[int], sampling: common_pb2.SamplingParams,
                   decode: WorkerState, deadline: float | None) -> PushStart | None:
    """Steps 1-3 (see the module docstring). None: no Decode call was dispatched (take the pull path under
    ``request_id``). Raises the typed error of a non-retryable prefill failure."""
    prompt = PromptBlocks.of(prompt)
    if router.policy.matched_tokens(decode, prompt):  # decode's prefix cache holds part of the prompt: the pull
        router.counters["push_skipped_prefix_held"] += 1  # path moves only the rest (delta) or skips the prefill
        return None
    prefill = router.pick(PREFILL, prompt, set())
    if prefill is None or not prefill.kv_endpoint:
        return None
    uncached = len(prompt) - router.policy.matched_tokens(prefill, prompt)
    disagg = router.disagg
    if disagg.mode != "always" and disagg.decide(uncached, disagg.prefill_queue.wait_s(prefill.address), decode.running_requests,
                                                 disagg.local_queue.wait_s(decode.address)).local:
        return None
    bootstrap_id = secrets.token_hex(16)
    call = decode.stub.Decode(
        decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt.token_ids, sampling=sampling,
                                 push_bootstrap_id=bootstrap_id, push_endpoint=prefill.kv_endpoint),
        timeout=hop_timeout(deadline),
    )
    keep = False
    try:
        resp = await _try_prefill(router, prefill, request_id, prompt, sampling, uncached, deadline, bootstrap_id)
        if resp is None:
            router.counters["push_prefill_failures"] += 1
            return PushStart(None, None, pull_request_id(request_id))
        remote = RemotePrefill(prefill, resp)
        keep = resp.kv_pushed and not remote.finished
        if keep:
            router.counters["kv_pushed"] += 1
        elif not remote.finished:
            router.counters["push_fallbacks"] += 1
            logger.warning("request %s: KV push did not complete; pulling from %s", request_id, prefill.address)
        return PushStart(remote, call if keep else None, request_id if keep else pull_request_id(request_id))
    finally:
        if not keep:
            task = asyncio.get_running_loop().create_task(_drain(call))
            _draining.add(task)
            task.add_done_callback(_draining.discard)


async def _drain(call: grpc.aio.UnaryStreamCall) -> None:
    """Let an unneeded Decode call end by itself (its worker frees the blocks), cancelling it after ``DRAIN_S``."""
    try:
        await asyncio.wait_for(asyncio.shield(call.code()), DRAIN_S)
    except (asyncio.TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError):
        pass
    finally:
        if not call.done():
            call.cancel()
