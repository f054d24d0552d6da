"""Decode worker logic, without I/O of its own (the gRPC adapter is ``server.py``).

Lifecycle of one request (:meth:`DecodeWorker.decode`):
1. Check the request: request_id, and with a KV handle the first token of every choice, transport, KV layout (a mismatch is
   KVLayoutMismatch naming both), block count and what the engine will check (prompt, first token, a
   request that could never fit the pool): a refused request moves no KV.
2. Reserve local KV blocks: with a prefix cache (``--enable-prefix-caching``), share the cached blocks of the
   prompt's longest cached prefix (m full blocks), then allocate the rest (waits, bounded, while the pool is busy).
3. Fill the rest (delta transfer): pull the prefill worker's blocks ``block_ids[m:]`` over the KVReceiver (UCX)
   within min(transfer_timeout_s, the call's time left), or, with a ``via_store`` handle, read them from the KV
   store (whatever is missing is computed by the first decode step). When the cache held every block nothing is
   pulled (``DecodeRun.kv_not_pulled``: the caller must release the prefill worker's KV).
4. If the pull fails (unreachable, timeout, lease expired, corrupted): with ``transfer_failure="fallback"``
   free the blocks, recompute the prompt's KV with a local prefill and continue from the first token
   prefill produced (``DecodeRun.kv_recomputed``: the caller must release the prefill worker's KV); with
   ``"error"`` the error (KVTransferError / TransferNotFound) reaches the caller.
5. Join the running batch (continuous batching) and stream the tokens after the first: with n > 1 choices the
   engine forks n sequences over the one prompt KV, each continuing from its own first token; outputs carry the
   choice ``index`` (and logprobs when asked). Finish, cancel, deadline or error frees the blocks. Without a KV
   handle the request is prefilled here (``generate``; its stream starts with the first tokens, and the prompt's
   logprobs when asked). With ``resume_output_token_ids`` (decode migration) the prompt and those output tokens are
   prefilled here and the stream carries the tokens after them (``splitserve.engine.resume``).

Push (a job with ``push_id``, :mod:`splitserve.transfer.push`): steps 2-3 become: reserve the prompt's blocks,
subscribe under the bootstrap id on the prefill worker's KV sender (``push_endpoint``, from the router's
registry) and wait (at most ``push_timeout_s`` and the call's deadline) while the prefill worker writes the KV
layer group by layer group; its completion carries the first token of every choice. If the request finished at
prefill the blocks are freed and the stream ends empty. A failure (the prefill failed, the connection broke,
timeout) frees the blocks and raises KVTransferError: the router, which then has no first tokens from that
prefill, recomputes the request elsewhere (its local-prefill fallback).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.core import RequestOutput
from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.engine.prefix_cache import PrefixCachingBlockManager
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest, KVTransferError, TransferNotFound
from splitserve.services.decode.kv_store import DecodeStore
from splitserve.telemetry.transfer import observe_receive
from splitserve.telemetry.workers import observe_decode
from splitserve.transfer.base import KVReceiver
from splitserve.transfer.handle import KVHandle

logger = logging.getLogger(__name__)

#: the local prefill of a fallback only rebuilds the prompt's KV; its sampled token is discarded
_RECOMPUTE = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
MAX_REQUEST_ID_LEN = 256


@dataclass(frozen=True, slots=True)
class DecodeJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: int | None = None  # the token prefill produced (choice 0); with ``handle``, this or ``first_token_ids``
    handle: KVHandle | None = None  # where the prompt's KV is; None: prefill here
    time_remaining: float | None = None  # seconds left of the caller's deadline (None: none)
    first_token_ids: tuple[int, ...] = ()  # every choice's first token (``params.n`` of them); (): (first_token_id,)
    resume_output_token_ids: tuple[int, ...] = ()  # migration: the choice's output so far (no handle; prefilled here)
    push_id: str = ""  # push: the bootstrap id to subscribe under ("": no push)
    push_endpoint: str = ""  # push: the prefill worker's KV sender (host:port)

    @property
    def first_tokens(self) -> list[int]:
        """The first token of every choice (choice i at index i); [] when none was given."""
        if self.first_token_ids:
            return list(self.first_token_ids)
        return [] if self.first_token_id is None else [self.first_token_id]


class DecodeRun:
    """The outputs of one request (an async iterator of RequestOutput; ``aclose()`` aborts it). Steps 1-4
    run on the first iteration; ``kv_recomputed`` is final once the first output arrived."""

    def __init__(self, job: DecodeJob, outputs: Callable[[DecodeRun], AsyncIterator[RequestOutput]]) -> None:
        self.job = job
        self.kv_recomputed = False
        self.kv_not_pulled = False  # the prefix cache held every prompt block: the prefill worker's KV was not pulled
        self.kv_transfer_s: float | None = None  # seconds the KV pull took (a pull from the prefill worker only)
        self._outputs = outputs(self)

    def __aiter__(self) -> DecodeRun:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        await self._outputs.aclose()


class DecodeWorker:
    """Counters (plain ints, event-loop thread): ``num_requests``, ``streams_open``, ``num_local_prefills``,
    ``num_kv_fallbacks``, ``num_prefix_reused_blocks`` (prompt blocks taken from the prefix cache, not transferred)."""

    def __init__(
        self, engine: AsyncEngine, receiver: KVReceiver, transport: str, transfer_timeout_s: float,
        transfer_failure: str = "fallback", store: DecodeStore | None = None, push_timeout_s: float = 60.0,
        push_layer_groups: int = 0,
    ) -> None:
        if transfer_failure not in ("fallback", "error"):
            raise ValueError(f"transfer_failure must be 'fallback' or 'error', got {transfer_failure!r}")
        self.engine = engine
        if isinstance(engine.block_manager, PrefixCachingBlockManager):  # (set before any request runs)
            engine.block_manager.keep_partial_blocks = True  # a later turn copies them instead of pulling their rows
        self.receiver = receiver
        self.transport = transport
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_failure = transfer_failure
        self.store = store
        self.push_timeout_s = push_timeout_s
        self.push_layer_groups = push_layer_groups  # messages per block of a push (0: one per layer)
        self.num_pushes = 0
        self.num_requests = 0
        self.streams_open = 0
        self.num_local_prefills = 0
        self.num_kv_fallbacks = 0
        self.num_prefix_reused_blocks = 0
        self.num_prefix_reused_tokens = 0  # tokens of partly held blocks copied from the prefix cache, not transferred

    def decode(self, job: DecodeJob) -> DecodeRun:
        """The request's outputs (see the module docstring). Iterating raises InvalidRequest,
        KVLayoutMismatch, CapacityExhausted, and with ``transfer_failure="error"`` KVTransferError /
        TransferNotFound."""
        return DecodeRun(job, self._outputs)

    async def _outputs(self, run: DecodeRun) -> AsyncIterator[RequestOutput]:
        job = run.job
        self.num_requests += 1
        self.streams_open += 1
        try:
            self._check(job)
            if job.push_id:
                async with contextlib.aclosing(self._pushed(job)) as outputs:
                    async for out in outputs:
                        yield out
                return
            if job.handle is None:
                self.num_local_prefills += 1
                stream = self.engine.generate(job.request_id, job.prompt_token_ids, job.params, job.resume_output_token_ids)
                async with contextlib.aclosing(observe_decode(stream, job.request_id, local_prefill=True)) as observed:
                    async for out in observed:  # closing it aborts the request in the engine at once
                        yield out
                return
            self.engine.check_decode(job.prompt_token_ids, job.params, list(job.first_tokens))  # refuse before taking blocks
            blocks, reused, held_rows = await self._reserve(job)
            async with blocks:
                try:
                    computed = await self._fill(run, blocks, reused, held_rows)
                except (KVTransferError, TransferNotFound) as exc:  # incl. timeout, unreachable, checksum mismatch
                    if self.transfer_failure == "error":
                        raise
                    blocks.free()  # the local prefill takes its own
                    self.num_kv_fallbacks += 1
                    logger.warning("KV pull for %s failed (%s); recomputing its prompt here", job.request_id, exc)
                    run.kv_recomputed = True
                    blocks, computed = await self._recompute(job), None  # (leaving the outer block frees nothing now)
                async with blocks:  # the engine takes them when the stream starts
                    stream = self.engine.decode_prefilled(
                        job.request_id, job.prompt_token_ids, job.params, list(job.first_tokens), blocks, computed
                    )
                    async with contextlib.aclosing(observe_decode(stream, job.request_id, local_prefill=run.kv_recomputed)) as observed:
                        async for out in observed:
                            yield out
        finally:
            self.streams_open -= 1

    async def _pushed(self, job: DecodeJob) -> AsyncIterator[RequestOutput]:
        """A push job: reserve, receive the push, decode from its first tokens (see the module docstring)."""
        if not job.push_endpoint:
            raise InvalidRequest("push_bootstrap_id needs push_endpoint")
        if job.params.max_tokens <= 1:
            raise InvalidRequest("max_tokens <= 1: the request finishes at prefill; nothing to decode")
        prompt = job.prompt_token_ids
        self.engine.check_decode(prompt, job.params, [0] * job.params.n)  # refuse before taking blocks
        t = self.push_timeout_s if job.time_remaining is None else max(0.001, min(self.push_timeout_s, job.time_remaining))
        async with await self.engine.allocate_blocks(-(-len(prompt) // self.engine.layout.block_size)) as blocks:
            with observe_receive(self.transport, job.push_endpoint, job.push_id, len(blocks), path=self.receiver.path) as obs:
                result = await self.receiver.receive_push(job.push_endpoint, job.push_id, blocks.block_ids,
                                                          self.push_layer_groups, t)
                obs.nbytes = result.nbytes
            self.num_pushes += 1
            if result.finished:
                return
            stream = self.engine.decode_prefilled(job.request_id, prompt, job.params, list(result.first_token_ids), blocks)
            async with contextlib.aclosing(observe_decode(stream, job.request_id, local_prefill=False)) as observed:
                async for out in observed:
                    yield out

    def _check(self, job: DecodeJob) -> None:
        """Refuse requests that lack what only the router supplies (a direct client's malformed call)."""
        if not job.request_id or len(job.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequest(f"request_id is required (1..{MAX_REQUEST_ID_LEN} characters)")
        h = job.handle
        if job.resume_output_token_ids and h is not None:
            raise InvalidRequest("resume_output_token_ids need a local prefill: send no kv_handle")
        if h is None:
            return
        first = job.first_tokens
        if not first:
            raise InvalidRequest("first_token_id is required with a kv_handle")
        if job.first_token_id is not None and job.first_token_ids and job.first_token_ids[0] != job.first_token_id:
            raise InvalidRequest("first_token_ids[0] differs from first_token_id")
        if len(first) != job.params.n:
            raise InvalidRequest(f"{len(first)} first tokens for n={job.params.n} choices")
        if not h.transfer_id or not h.endpoint or not h.block_ids:
            raise InvalidRequest("kv_handle needs transfer_id, endpoint and block_ids")
        self.engine.layout.on_device(self.engine.kv_cache.device.type).check_compatible(h.layout)
        if h.transport != self.transport:
            raise InvalidRequest(f"KV handle transport {h.transport!r}; this worker receives over {self.transport!r}")
        n = len(job.prompt_token_ids)
        if h.num_tokens != n or len(h.block_ids) != -(-n // self.engine.layout.block_size):
            raise InvalidRequest(f"KV handle covers {h.num_tokens} tokens in {len(h.block_ids)} blocks; prompt has {n} tokens")
        if job.params.max_tokens <= 1:
            raise InvalidRequest("max_tokens <= 1: the request finished at prefill; nothing to decode")

    async def _reserve(self, job: DecodeJob) -> tuple[OwnedBlocks, int, int]:
        """Step 2: blocks for the whole prompt, the first ``m`` shared from the prefix cache, and when the cache holds
        the next block's first ``r`` tokens (a previous turn's partial block) their rows copied into block ``m``;
        returns (blocks, m, r)."""
        async with await self.engine.match_prefix(job.prompt_token_ids) as held:  # freed if the allocation fails
            rest = await self.engine.allocate_blocks(len(job.handle.block_ids) - len(held))
            reused = len(held)
            self.num_prefix_reused_blocks += reused
            blocks = OwnedBlocks(held.take() + rest.take(), self.engine.core)
        held_rows = 0
        if reused < len(blocks.block_ids) and not job.handle.via_store:
            async with blocks:  # freed if cancelled meanwhile
                held_rows = await self.engine.copy_held_rows(job.prompt_token_ids, reused, blocks.block_ids[reused])
                blocks = blocks.move()
            self.num_prefix_reused_tokens += held_rows
        return blocks, reused, held_rows

    async def _fill(self, run: DecodeRun, blocks: OwnedBlocks, reused: int, held_rows: int = 0) -> int | None:
        """Step 3: put the prompt's KV into ``blocks`` after the first ``reused`` (already filled) and the first
        ``held_rows`` token rows of the next one (copied from the prefix cache); returns how many leading prompt
        tokens it covers (None: all)."""
        job = run.job
        h = job.handle
        t = self.transfer_timeout_s
        timeout = t if job.time_remaining is None else max(0.001, min(t, job.time_remaining))
        if h.via_store:  # store transfer mode: read from the KV store, recompute what is missing
            if self.store is None:
                return reused * self.engine.layout.block_size
            return await self.store.load_prompt(h, job.prompt_token_ids, blocks, timeout, skip_blocks=reused)
        src, dst = list(h.block_ids)[reused:], blocks.block_ids[reused:]
        bs = self.engine.layout.block_size
        if not src or reused * bs + held_rows == len(job.prompt_token_ids):
            run.kv_not_pulled = True
            return None
        with observe_receive(self.transport, h.endpoint, h.transfer_id, len(src), path=self.receiver.path) as obs:
            # the prompt's last block moves only its used token rows, a partly held first block only its missing ones
            last = len(job.prompt_token_ids) % bs
            t0 = time.monotonic()
            obs.nbytes = await self.receiver.fetch(h.endpoint, h.transfer_id, src, dst, timeout, last_block_tokens=last,
                                                   first_block_held=held_rows)
            run.kv_transfer_s = time.monotonic() - t0
        return None

    async def _recompute(self, job: DecodeJob) -> OwnedBlocks:
        """The prompt's KV rebuilt by a local prefill."""
        out = await self.engine.prefill(f"{job.request_id}#recompute", job.prompt_token_ids, _RECOMPUTE)
        if out.blocks is None:  # only if the prompt fills the context: then there is nothing to decode
            raise InvalidRequest("the prompt leaves no room to decode")
        return out.blocks

    def stats(self) -> dict[str, float]:
        s = self.receiver.stats
        counters = dict(
            requests=self.num_requests, streams_open=self.streams_open, local_prefills=self.num_local_prefills,
            kv_transfer_fallbacks=self.num_kv_fallbacks, kv_checksum_failures=s.checksum_failures,
            kv_prefix_reused_blocks=self.num_prefix_reused_blocks, kv_prefix_reused_partial_tokens=self.num_prefix_reused_tokens,
            ucx_bytes_received=s.bytes_received if self.transport == "ucx" else 0, kv_bytes_received=s.bytes_received,
            kv_transfers_ok=s.transfers_ok, kv_transfers_failed=s.transfers_failed, kv_pushes_received=self.num_pushes,
        )
        if self.store is not None:
            counters.update(self.store.stats())
        return counters
