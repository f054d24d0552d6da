"""Decode migration: a stream whose decode worker dies or stalls after tokens flowed continues on another decode
worker, token-exact, instead of ending with an error.

When the decode stream of a request fails mid-stream (UNAVAILABLE: the worker died, was cut off or drains; the
stall guard; any failure :func:`~splitserve.services.router.retry.retryable` allows, with time left before the
deadline), every choice that has not finished continues as its own request on another decode worker:

* the continuation is a ``DecodeRequest`` with the original prompt, choice i's sampling (``n`` 1, ``seed + i``:
  ``SamplingParams.for_choice``; no prompt logprobs, already sent) and ``resume_output_token_ids``: the tokens
  the router already passed on for that choice. The new worker prefills prompt + those tokens itself (no KV
  transfer: the simplest correct path) and counts them as output (``splitserve.engine.resume``), so max_tokens,
  min_tokens, penalties, stop ids, the grammar and seeded draws continue where they stopped;
* its events keep the choice's ``index``; the client sees no duplicate and no gap (a token is recorded as sent
  exactly when it is yielded);
* the continuation may be retried on other workers before its own stream starts (``decode_attempts``, as any
  decode leg), and may itself migrate again: a choice moves at most ``decode_migrations`` times (0: migration is
  off and a mid-stream failure ends the request with its typed error, as before);
* it never picks a worker that already failed this request, and gets the request's deadline as its timeout.

Each migration is logged, counted in the router's counters (``decode_migrations``) and in
``splitserve:router_decode_migrations_total{reason}``.

Exactness: greedy continuations equal an uninterrupted run (the recomputed logits may differ from the decoded ones
in the last float bits only); seeded sampling continues the same random stream (token i is drawn with a generator
seeded by (seed, i)), so a seeded choice gives the same tokens too unless a draw falls within that float noise of a
CDF boundary. Unseeded sampling continues with fresh randomness (as any unseeded run).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pd.v1 import common_pb2

from splitserve.errors import PdError
from splitserve.frontend.backend import TokenEvent
from splitserve.services.router.merge import merge
from splitserve.services.router.registry import DECODE
from splitserve.telemetry.metrics import ROUTER_DECODE_MIGRATIONS

if TYPE_CHECKING:
    from splitserve.services.router.decode_leg import DecodeLeg

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256  # as the workers accept


def choice_sampling(sampling: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Choice ``index``'s sampling as a request of its own (``SamplingParams.for_choice`` on the wire): n unset
    (1), seed + index when seeded; prompt_logprobs cleared (the client already has them)."""
    msg = common_pb2.SamplingParams()
    msg.CopyFrom(sampling)
    msg.ClearField("n")
    msg.ClearField("prompt_logprobs")
    if msg.HasField("seed"):
        msg.seed = (msg.seed + index) % 2**63
    return msg


def suffixed_id(request_id: str, suffix: str) -> str:
    """``request_id`` + ``suffix``, the base cut so the result stays within what the workers accept: the id of a
    leg that may run beside another leg of the same request on one worker (the base stays readable in logs)."""
    return request_id[: MAX_REQUEST_ID_LEN - len(suffix)] + suffix


def continuation_id(request_id: str, index: int, move: int) -> str:
    """The request id of choice ``index``'s ``move``-th continuation (unique on a worker; the base stays readable)."""
    return suffixed_id(request_id, f"~m{move}c{index}")


def continue_choices(leg: DecodeLeg, err: PdError, reason: str) -> AsyncIterator[TokenEvent]:
    """The events of ``leg``'s unfinished choices, each continued on another decode worker (module docstring).

    Raises (while iterating):
        PdError: ``err`` (the failure that ended ``leg``'s stream) when a choice finds no worker to move to, or
            the typed error of a continuation that failed and could not move again.
    """
    streams = [_continue(leg, i, err, reason) for i in sorted(leg.open_choices)]
    return streams[0] if len(streams) == 1 else merge(streams)


async def _continue(leg: DecodeLeg, index: int, err: PdError, reason: str) -> AsyncIterator[TokenEvent]:
    from splitserve.services.router.decode_leg import DecodeLeg  # (decode_leg imports this module)

    router = leg.router
    history = list(leg.generated.get(index, ()))
    nxt = router.pick(DECODE, leg.prompt, leg.tried)
    if nxt is None:
        logger.warning("request %s choice %d: decode worker %s failed mid-stream (%s) after %d tokens; no other "
                       "decode worker to continue on", leg.request_id, index, leg.decode.address, reason, len(history))
        raise err
    move = leg.migrations + 1
    router.counters["decode_migrations"] += 1
    ROUTER_DECODE_MIGRATIONS.labels(reason).inc()
    logger.warning("request %s choice %d: decode worker %s failed mid-stream (%s) after %d tokens; continuing on %s "
                   "(migration %d of %d)", leg.request_id, index, leg.decode.address, reason, len(history), nxt.address,
                   move, router.decode_migrations)
    cont = DecodeLeg(router, continuation_id(leg.request_id, index, move), leg.prompt,
                     choice_sampling(leg.sampling, index), nxt, None, leg.deadline,
                     resume=(index, history), migrations=move, tried=leg.tried)
    async with contextlib.aclosing(cont.events()) as events:  # closed with this generator (the merge or the caller)
        async for ev in events:
            yield ev
