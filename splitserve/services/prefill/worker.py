"""Prefill worker logic, without I/O of its own (the gRPC adapter is ``server.py``).

Lifecycle of one request (:meth:`PrefillWorker.prefill`):
1. Check the request (request_id, a non-empty prompt).
2. With a KV store: look up the prompt's longest cached prefix and read it into fresh KV blocks
   (``PrefillStore.prefill``); then the engine prefill (batched with concurrent prompts) computes the rest
   and samples the first token of each of the request's n choices (with logprobs, and the prompt's logprobs, when
   asked; a request with ``prompt_logprobs`` reads nothing from the store: every prompt position is computed).
3. Unless the request finished at prefill: publish the prompt's new full blocks to the store (a background
   write with its own share of the blocks) and, in store transfer mode when PutStart succeeded, free the
   blocks (the decode worker reads the store); otherwise hold them under a fresh transfer_id (``KVLeases``)
   until the decode worker pulls them, releases them, or the lease (``lease_s``) ends.
4. Answer with the first tokens and a :class:`KVHandle` naming the blocks and the data-plane endpoint (one
   transfer for all n choices: they share the prompt's KV).

Push (a request with a bootstrap id, :mod:`splitserve.transfer.push`): step 2 also writes each layer group of
the prompt's KV into the decode worker's subscribed blocks as soon as it is computed, then the completion with
the first tokens; step 3 then holds nothing (``pushed``; the store still gets its copy). A failure of the
prefill (invalid, cancelled, deadline) sends a failure message instead; a push that cannot complete (no
subscription within the sender's wait, the decode side's connection failed) falls back to the lease of step 3.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import DeadlineExceeded, InvalidRequest
from splitserve.kvstore.kv_blocks import tail_key
from splitserve.services.prefill.kv_leases import KVLeases
from splitserve.services.prefill.kv_store import PrefillStore
from splitserve.telemetry.workers import observe_prefill
from splitserve.transfer.base import KVSender
from splitserve.transfer.handle import KVHandle

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256
#: a lease outlives its caller's deadline by at most this (s): time for a response sent just in time to be used
LEASE_DEADLINE_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """One prefill's answer. Per-choice fields have n entries, choice i at index i."""

    first_token_ids: tuple[int, ...]
    finish_reason: str | None  # set when the request finished at prefill (every choice did): then ``handle`` is None
    cached_tokens: int  # prompt tokens whose KV came from the store
    handle: KVHandle | None
    first_logprobs: tuple[TokenLogprob, ...] | None = None  # per choice, when ``params.logprobs`` is set
    prompt_logprobs: PromptLogprobs | None = None  # when ``params.prompt_logprobs`` is set (first entry None)
    finish_reasons: tuple[str | None, ...] = ()  # per choice: set when that choice ended with its first token
    pushed: bool = False  # push: the KV is in the decode worker's blocks; nothing is held here (``handle`` None)

    @property
    def first_token_id(self) -> int:
        """Choice 0's first token."""
        return self.first_token_ids[0]


class PrefillWorker:
    """Counters (plain ints, event-loop thread): ``num_requests`` (answered), ``in_flight``; ``leases`` holds
    the KV waiting for decode workers."""

    def __init__(
        self, engine: AsyncEngine, sender: KVSender, transport: str, lease_s: float, store: PrefillStore | None = None,
        advertise: str | None = None,
    ) -> None:
        self.engine = engine
        self.sender = sender
        self.transport = transport
        self.lease_s = lease_s
        self.store = store
        self.advertise = advertise
        self.leases = KVLeases(sender, lease_s)
        self.num_requests = 0
        self.in_flight = 0
        self.num_pushed = 0
        self.num_push_fallbacks = 0
        self._failing: set[asyncio.Task] = set()

    @property
    def endpoint(self) -> str:
        """The data-plane endpoint put in KV handles."""
        return self.advertise or self.sender.endpoint

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      time_remaining: float | None = None, push_id: str = "") -> PrefillResult:
        """Steps 1-4 for ``prompt`` (token ids); ``time_remaining``: seconds left of the caller's deadline;
        ``push_id``: the push bootstrap id ("" : pull). Cancel-safe (the engine aborts the prefill, blocks are
        freed, a push's decode side is told). Raises InvalidRequest, CapacityExhausted (the engine's KV queue),
        DeadlineExceeded (the prefill finished after the caller's deadline: its KV is freed at once, never leased)."""
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        self.in_flight += 1
        push = None
        try:
            if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
                raise InvalidRequest(f"request_id is required (1..{MAX_REQUEST_ID_LEN} characters)")
            if not prompt:
                raise InvalidRequest("prompt_token_ids is empty")
            if push_id:
                try:
                    push = self.sender.open_push(push_id, -(-len(prompt) // self.engine.layout.block_size))
                except ValueError as exc:
                    raise InvalidRequest(str(exc)) from None
            hook = None if push is None else push.layers_done
            with observe_prefill(request_id, len(prompt)) as obs:
                if self.store is not None:
                    out = await self.store.prefill(request_id, prompt, params, time_remaining, on_layers=hook)
                else:
                    out = await self.engine.prefill(request_id, prompt, params, on_layers=hook)
                obs.done(out.cached_tokens, out.finish_reason)
            handle, pushed = None, False
            if out.blocks is not None:
                async with out.blocks as blocks:  # freed on exit unless a lease took them
                    if deadline is not None and time.monotonic() >= deadline:  # nobody will take the handle
                        raise DeadlineExceeded(f"prefill of {request_id} finished after its caller's deadline; KV freed")
                    if push is not None:
                        pushed = await self._finish_push(push, out.first_token_ids, blocks.block_ids, deadline)
                        push = None
                    if pushed:
                        if self.store is not None:  # the store's own share of the blocks; ours are freed on exit
                            await self.store.publish(prompt, out.cached_tokens, blocks, uuid.uuid4().hex)
                    else:
                        handle = await self._hand_over(request_id, prompt, out.cached_tokens, blocks, deadline)
            elif push is not None:  # finished at prefill: the decode side frees its blocks and ends
                await self._finish_push(push, out.first_token_ids, None, deadline)
                push = None
        except BaseException as exc:
            if push is not None:  # the decode side must not wait for KV that will not come
                if isinstance(exc, asyncio.CancelledError):  # its caller went away: a normal end
                    self._fail_push(push, f"prefill of {request_id} cancelled", cancelled=True)
                else:
                    self._fail_push(push, f"prefill of {request_id} failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self.in_flight -= 1
        self.num_requests += 1
        return PrefillResult(tuple(out.first_token_ids), out.finish_reason, out.cached_tokens, handle,
                             None if out.first_logprobs is None else tuple(out.first_logprobs), out.prompt_logprobs,
                             tuple(out.finish_reasons), pushed)

    async def _finish_push(self, push, first_token_ids: list[int], block_ids: list[int] | None,
                           deadline: float | None) -> bool:
        """Send the rest of the KV and the completion; True when the decode side has it all (else the lease)."""
        timeout = 30.0 if deadline is None else max(0.001, deadline - time.monotonic() + LEASE_DEADLINE_GRACE_S)
        ok = await push.finish(first_token_ids, block_ids, block_ids is None, timeout)
        if block_ids is not None:
            if ok:
                self.num_pushed += 1
            else:
                self.num_push_fallbacks += 1
                logger.warning("KV push %s did not complete; holding the KV for a pull", push.bootstrap_id)
        return ok

    def _fail_push(self, push, detail: str, cancelled: bool = False) -> None:
        """Send a push's failure (``cancelled``: the request was cancelled) in the background (it survives the
        cancel of the request that failed)."""
        task = asyncio.get_running_loop().create_task(push.fail(detail, cancelled=cancelled))
        self._failing.add(task)
        task.add_done_callback(self._failing.discard)

    async def _hand_over(self, request_id: str, prompt: list[int], cached_tokens: int, blocks: OwnedBlocks,
                         deadline: float | None) -> KVHandle:
        """Step 3: publish ``blocks`` to the store and/or hold them under a lease (consuming them). The lease ends
        ``LEASE_DEADLINE_GRACE_S`` after the caller's ``deadline`` (monotonic s) at the latest: a caller that is
        gone (its deadline expired as the prefill finished) leaves no KV held for the whole lease."""
        transfer_id = uuid.uuid4().hex
        block_ids = blocks.block_ids
        via_store = False
        lease_s = self.lease_s
        if self.store is not None:
            via_store = await self.store.publish(prompt, cached_tokens, blocks, transfer_id)
        if not via_store:
            bound = None if deadline is None else deadline - time.monotonic() + LEASE_DEADLINE_GRACE_S
            lease_s = self.leases.hold(transfer_id, blocks, bound)
        partial = len(prompt) % self.engine.layout.block_size
        layout = self.engine.layout.on_device(self.engine.kv_cache.device.type)
        return KVHandle(
            request_id, transfer_id, len(prompt), layout, self.transport, self.endpoint, tuple(block_ids),
            int(lease_s * 1000), via_store, tail_key(transfer_id) if via_store and partial else "",
        )

    def release(self, transfer_id: str) -> bool:
        """Free the KV held under ``transfer_id`` (the decode leg will not pull it); False if none is held."""
        return self.leases.release(transfer_id)

    def stats(self) -> dict[str, float]:
        s = self.sender.stats
        counters = dict(
            requests=self.num_requests, prefills_in_flight=self.in_flight, kv_transfers_held=len(self.leases),
            kv_leases_expired=self.leases.expired, ucx_bytes_sent=s.bytes_sent if self.transport == "ucx" else 0,
            kv_bytes_sent=s.bytes_sent, kv_transfers_ok=s.transfers_ok, kv_transfers_failed=s.transfers_failed,
            kv_pushes=self.num_pushed, kv_push_fallbacks=self.num_push_fallbacks, kv_pushes_pending=len(self.sender.push_table),
        )
        if self.store is not None:
            counters.update(self.store.stats())
        return counters
