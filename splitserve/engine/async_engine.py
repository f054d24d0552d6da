"""asyncio face of the engine: per-request async streams over the engine-core thread.

``EngineConfig`` lives in :mod:`splitserve.engine.config` (no torch) and is re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Sequence as Seq
from typing import AsyncIterator, Callable

import torch

from splitserve.engine.admission import check_fits, max_blocks
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.choices import fork_stream, generate_choices
from splitserve.engine.core import EngineCore, RequestOutput
from splitserve.engine.guided import GuidedMatcher
from splitserve.engine.prefill_output import PrefillOutput  # re-exported: callers import it from here
from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.engine.prefix_cache import PrefixCachingBlockManager
from splitserve.engine.resume import resume_sequence
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence, SeqMode
from splitserve.errors import InvalidRequest
from splitserve.kvstore.block_hash import namespace_root
from splitserve.model import LoadedModel
from splitserve.engine.cuda_graphs import CudaGraphDecoder, graphs_enabled
from splitserve.engine.device import allocate_kv_cache_on
from splitserve.transfer.layout import KVLayout

logger = logging.getLogger(__name__)


class AsyncEngine:
    """One model with its paged KV cache, served to asyncio code.

    Modes: ``generate`` (prefill + decode here), ``prefill`` (first token, KV blocks handed to the
    caller), ``decode_prefilled`` (KV already placed in blocks from ``allocate_blocks``).

    KV block ownership: every KV block outside a running request has exactly one owner, an
    :class:`~splitserve.engine.owned_blocks.OwnedBlocks` (from ``allocate_blocks``, from ``prefill``'s
    output, or from ``OwnedBlocks.share``). The owner frees them (``free()``, idempotent, or leaving
    ``async with``) or hands them on, which consumes it: to this engine (``prefill(cached=...)``,
    ``decode_prefilled``: taken when the engine accepts the request; an InvalidRequest raised before that
    leaves them with the caller), or to a holder such as a KV lease or a store write (``move``/``share``).
    Nothing else frees blocks, so an error path can neither leak them nor free them twice.

    KV capacity: a request that needs more blocks than the whole pool is refused at once
    (InvalidRequest); one that fits the pool waits in a bounded FIFO queue until its blocks are free
    (``max_queue_len`` / ``max_queue_wait_s``; past them CapacityExhausted). See ``engine.admission``.
    """

    def __init__(self, lm: LoadedModel, config: EngineConfig) -> None:
        """Raises ValueError when ``config.max_model_len`` exceeds the model's context length, when
        ``config.dtype`` (unless "auto") is not the dtype ``lm`` was loaded in, or ``config.device`` not the device
        it was loaded on (``load_model(..., device=)``)."""
        self.lm = lm
        self.config = config
        if config.dtype not in ("auto", lm.config.dtype):
            raise ValueError(f"--dtype {config.dtype}: the model was loaded in {lm.config.dtype}")
        if config.max_model_len > lm.max_model_len:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's maximum context length {lm.max_model_len}")
        device = lm.model.lm_head.weight.device
        want = torch.device(config.device)
        if want.type != device.type or want.index not in (None, device.index):
            raise ValueError(f"--device {config.device}: the model was loaded on {device}")
        self.max_model_len = config.max_model_len or lm.max_model_len
        mc = lm.config
        self.layout = KVLayout(lm.model_id, mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, mc.dtype)
        num_blocks = config.num_blocks or max(1, config.kv_cache_mb * 2**20 // self.layout.block_nbytes)
        graphs = graphs_enabled(config.device, config.enforce_eager)
        # CUDA graphs: one more KV block (id num_blocks, never handed out) takes the padding rows' K/V
        self.kv_cache = allocate_kv_cache_on(self.layout, num_blocks + (1 if graphs else 0), str(device))
        self.block_manager = (PrefixCachingBlockManager(num_blocks, config.block_size, namespace_root(self.layout))
                              if config.enable_prefix_caching else BlockManager(num_blocks))
        sched = Scheduler(
            SchedulerConfig(
                config.block_size, config.max_num_seqs,
                config.token_budget(self.max_model_len),
                self.max_model_len, chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
            lm.eos_token_ids,
        )
        decoder = None
        if graphs:
            decoder = CudaGraphDecoder(lm.model, self.kv_cache, config.block_size, config.max_num_seqs, self.max_model_len,
                                       scratch_block=num_blocks)
        runner = ModelRunner(lm, self.kv_cache, config.block_size, config.decode_threads, graphs=decoder)
        self.core = EngineCore(runner, sched, self._emit_threadsafe,
                               config.max_queue_len, config.max_queue_wait_s)
        longest = max_blocks(1, self.max_model_len, config.block_size, self.max_model_len, prefill_only=False)
        if longest > num_blocks:
            pool_tokens = num_blocks * config.block_size
            logger.warning("the KV pool (%d blocks of %d tokens) cannot hold one request of the full context (%d tokens): "
                           "a prompt longer than %d tokens, or a generation whose prompt + max_tokens exceeds %d, is refused",
                           num_blocks, config.block_size, self.max_model_len, pool_tokens, pool_tokens + 1)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def device(self) -> torch.device:
        """Where the weights and the KV cache live (``kv_cache.device``)."""
        return self.kv_cache.device

    def sync_kv(self) -> None:
        """Block until every queued step's KV writes are in the cache's memory (a GPU's stream synchronised; no-op
        on cpu). For a component about to read KV blocks from outside the engine thread (a UCX send, a store
        write). Steps already sync when their sampled tokens come back, so KV of an emitted token is in memory."""
        self.core.runner.sync()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start()

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.core.stop)

    # --- outputs from the engine thread ----------------------------------------------------
    def _emit_threadsafe(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
            elif out.block_ids:  # consumer gone before it took ownership of the KV blocks
                self.core.free(out.block_ids)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, prefill_only: bool = False) -> None:
        if not prompt_token_ids:
            raise InvalidRequest("prompt must contain at least one token")
        vocab = self.lm.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the model's context is {self.max_model_len}")
        self.check_capacity(len(prompt_token_ids), params, prefill_only)

    def check_capacity(self, num_prompt_tokens: int, params: SamplingParams, prefill_only: bool = False) -> None:
        """Raises InvalidRequest when the request could never fit this worker's KV pool: its prompt (a
        prefill), or prompt + ``params.max_tokens`` (capped by the context; a generation or decode).
        A request that fits waits for free blocks instead of failing."""
        check_fits(num_prompt_tokens, params.max_tokens, self.config.block_size, self.max_model_len, self.num_blocks, prefill_only)

    async def run_sequences(self, seqs: list[Sequence], blocks: OwnedBlocks | None = None, copies: OwnedBlocks | None = None,
                      choices: range | None = None) -> AsyncIterator[RequestOutput]:
        """(Engine internals; ``splitserve.engine.choices`` uses it.)
        Run ``seqs`` (one request: one sequence, or the forked choices of an n > 1 request, which take
        ``blocks`` and ``copies`` as ``EngineCore.fork`` says) and yield their outputs until every choice
        (``choices``, default each sequence's index) finished or an output hands over KV blocks."""
        request_id = seqs[0].request_id
        fork = len(seqs) > 1
        if fork:
            block_ids, copy_ids = blocks.take(), [] if copies is None else copies.take()
        elif blocks is not None:  # the engine accepts the request: the blocks are ours from here on
            seqs[0].block_table = blocks.take()
        if request_id in self._queues:
            for ids in ((block_ids, copy_ids) if fork else (seqs[0].block_table,)):
                if ids:
                    self.core.free(ids)
            raise InvalidRequest(f"duplicate request_id {request_id}")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        remaining = set(choices if choices is not None else (s.index for s in seqs))
        finished = False
        try:
            if fork:
                self.core.fork(seqs, block_ids, copy_ids)
            else:
                self.core.add(seqs[0])
            while True:
                out: RequestOutput = await q.get()
                if out.error is not None:
                    finished = True
                    raise out.error
                if out.finish_reason is not None:
                    remaining.discard(out.index)
                finished = not remaining or out.block_ids is not None
                yield out
                if finished:
                    return
        finally:
            del self._queues[request_id]
            if not finished:
                self.core.abort(request_id)
                while not q.empty():  # outputs that raced the abort may carry KV blocks
                    late = q.get_nowait()
                    if late.block_ids:
                        self.core.free(late.block_ids)

    def _decode_seq(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_token_id: int,
                    index: int, num_computed_tokens: int) -> Sequence:
        seq = Sequence(request_id, list(prompt_token_ids), params, SeqMode.DECODE_PREFILLED, index=index)
        seq.output_token_ids = [first_token_id]
        seq.num_computed_tokens = num_computed_tokens
        seq.matcher = self._matcher(params)
        if seq.matcher is not None and not seq.matcher.accept(first_token_id):
            raise InvalidRequest(f"first token {first_token_id} of choice {index} violates the structured-output grammar")
        return seq

    def _matcher(self, params: SamplingParams) -> GuidedMatcher | None:
        """A fresh grammar matcher for ``params.guided`` (None without). Raises InvalidRequest (bad spec)."""
        if params.guided is None:
            return None
        from splitserve.engine.guided import make_matcher  # the grammar library loads on first use

        return make_matcher(params.guided, self.lm.tokenizer, self.lm.config.vocab_size, self.lm.eos_token_ids)

    # --- public API ----------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 resume_output_token_ids: Seq[int] = ()) -> AsyncIterator[RequestOutput]:
        """Prefill and decode here; yields one RequestOutput per step and choice. Closing the iterator aborts.

        n > 1 (``params.n``): one prefill samples every choice's first token (outputs index 0..n-1, in order), then
        the choices decode as forked sequences sharing the prompt's KV blocks (``decode_prefilled``); the
        stream ends when every choice has finished.

        ``resume_output_token_ids`` (one choice, n = 1): continue a choice that already generated these tokens
        elsewhere; they count as its output (``splitserve.engine.resume``) and the stream yields the tokens after
        them. Raises InvalidRequest (bad prompt, too big, bad grammar, a resume that cannot continue)."""
        self._validate(prompt_token_ids, params)
        if resume_output_token_ids:
            seq = resume_sequence(request_id, prompt_token_ids, params, resume_output_token_ids, self.lm.config.vocab_size,
                                  self.core.scheduler.stop_reason, self._matcher(params))
            return self.run_sequences([seq])
        if params.n > 1:
            return generate_choices(self, request_id, prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, SeqMode.GENERATE)
        seq.matcher = self._matcher(params)
        return self.run_sequences([seq])

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        cached: OwnedBlocks | None = None, num_cached_tokens: int = 0,
        on_layers: Callable[[list[int], int], None] | None = None,
    ) -> PrefillOutput:
        """Run prefill; returns the first token of each of the ``params.n`` choices (choice i sampled with
        ``params.for_choice(i)`` from the last prompt position's logits) and, unless every choice finished, the
        prompt's KV blocks (owned by the caller). With ``params.prompt_logprobs`` the prompt's logprobs too.
        Cancel-safe: a cancelled caller's request is aborted and its blocks freed.

        ``cached`` (e.g. from ``allocate_blocks``, filled from the KV store) already holds the K/V of the
        first ``num_cached_tokens`` prompt tokens; only the rest is computed. The engine takes the blocks
        once the arguments are valid (then frees them on any later error). ``num_cached_tokens`` must be
        below the prompt length (the last prompt token is always computed: its logits give the first
        token). A request with ``params.prompt_logprobs`` must compute the whole prompt (no ``cached``).
        Raises InvalidRequest (``cached`` then stays with the caller).

        ``on_layers(block_table, num_layers)`` (KV push) is called on the engine thread after each layer of the
        step that completes the prompt: the prompt's K/V of layers ``[0, num_layers)`` is then in the blocks.
        """
        self._validate(prompt_token_ids, params, prefill_only=True)
        if params.prompt_logprobs is not None and num_cached_tokens:
            raise InvalidRequest("prompt_logprobs needs every prompt token computed: pass no cached KV blocks")
        self._check_cached(len(prompt_token_ids) - 1, [] if cached is None else cached.block_ids, num_cached_tokens)
        seq = Sequence(request_id, list(prompt_token_ids), params, SeqMode.PREFILL_ONLY, on_layers=on_layers)
        seq.num_computed_tokens = seq.cached_tokens = num_cached_tokens
        seq.matcher = self._matcher(params)  # masks every choice's first token
        outs: list[RequestOutput] = []
        async with contextlib.aclosing(self.run_sequences([seq], cached, choices=range(params.n))) as stream:
            async for out in stream:
                outs.append(out)
        if len(outs) != params.n:
            raise RuntimeError(f"prefill produced {len(outs)} outputs for {params.n} choices")
        blocks = next((OwnedBlocks(o.block_ids, self.core) for o in outs if o.block_ids is not None), None)
        logprobs = [o.logprobs[0] for o in outs] if params.logprobs is not None else None
        return PrefillOutput(request_id, [o.token_ids[0] for o in outs], [o.finish_reason for o in outs],
                             outs[0].cached_tokens, blocks, logprobs, outs[0].prompt_logprobs)

    def check_decode(self, prompt_token_ids: list[int], params: SamplingParams, first_token_id: int | list[int]) -> None:
        """What ``decode_prefilled`` checks first, for callers that move KV only for an acceptable request:
        the prompt (non-empty token ids in the vocabulary, shorter than the context), the first token(s) in the
        vocabulary (one per choice when ``params.n`` > 1), and that prompt + ``params.max_tokens`` could fit the
        pool. Raises InvalidRequest."""
        self._validate(prompt_token_ids, params)
        firsts = [first_token_id] if isinstance(first_token_id, int) else list(first_token_id)
        if len(firsts) != params.n:
            raise InvalidRequest(f"{len(firsts)} first token ids for n={params.n} choices")
        vocab = self.lm.config.vocab_size
        if any(not 0 <= t < vocab for t in firsts):
            raise InvalidRequest(f"first_token_id {firsts} is outside the vocabulary [0, {vocab})")

    def _check_cached(self, max_tokens: int, block_ids: list[int], num_tokens: int) -> None:
        bs = self.config.block_size
        if not 0 <= num_tokens <= max_tokens or num_tokens > len(block_ids) * bs:
            raise InvalidRequest(f"{num_tokens} cached tokens in {len(block_ids)} blocks of {bs}: out of range (at most {max_tokens})")
        if any(not 0 <= b < self.num_blocks for b in block_ids) or len(set(block_ids)) != len(block_ids):
            raise InvalidRequest("cached block ids out of range or repeated")

    def decode_prefilled(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_token_ids: int | list[int],
        blocks: OwnedBlocks, num_computed_tokens: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Continue a request whose prompt KV is already in ``blocks`` (``ceil(prompt tokens / block_size)``
        of them); yields the tokens after the first token(s). Arguments are checked at once (InvalidRequest
        leaves the blocks with the caller); the engine takes the blocks when the returned stream is first
        iterated (BlocksReleased if the caller freed them before). Closing the stream aborts the request.

        ``num_computed_tokens`` (default: the whole prompt) prompt tokens have K/V in the blocks; the first
        step then computes the remaining prompt tokens together with the first token (e.g. the part of
        a prompt that could not be read from the KV store).

        n > 1: ``first_token_ids`` has one token per choice (as ``prefill`` sampled them). Choices whose first
        token ended them (same stop rules as prefill) are skipped; the others fork: each decodes as its own
        sequence (``params.for_choice(i)``, own grammar matcher) sharing the prompt's full KV blocks, with a
        copy of the partial last block; every output carries its choice ``index``. The stream ends when all
        choices have finished. Raises InvalidRequest also when every choice finished already."""
        self.check_decode(prompt_token_ids, params, first_token_ids)
        firsts = [first_token_ids] if isinstance(first_token_ids, int) else list(first_token_ids)
        computed = len(prompt_token_ids) if num_computed_tokens is None else num_computed_tokens
        self._check_cached(len(prompt_token_ids), blocks.block_ids, computed)
        if params.n == 1:
            return self.run_sequences([self._decode_seq(request_id, prompt_token_ids, params, firsts[0], 0, computed)], blocks)
        stop = self.core.scheduler.stop_reason
        children = [self._decode_seq(request_id, prompt_token_ids, params.for_choice(i), tok, i, computed)
                    for i, tok in enumerate(firsts)
                    if stop(params.for_choice(i), tok, 1, len(prompt_token_ids) + 1) is None]
        if not children:
            raise InvalidRequest("every choice finished at its first token: nothing to decode")
        return fork_stream(self, children, blocks)

    async def allocate_blocks(self, num_blocks: int, *, wait: bool = True) -> OwnedBlocks:
        """Reserve ``num_blocks`` KV blocks (e.g. to receive a transfer into), owned by the caller:
        ``async with await engine.allocate_blocks(n) as blocks:`` frees them on exit unless handed on.

        With ``wait`` (default) it waits its turn (FIFO) until the blocks are free: blocks held by leases,
        store writes or running requests come back. Without ``wait`` it takes them only if free right now.

        Raises:
            InvalidRequest: more blocks than the whole pool.
            CapacityExhausted: queue full or ``max_queue_wait_s`` passed (``wait``); not free now (no ``wait``).

        Cancel-safe: a cancelled caller leaves the queue, and blocks it got meanwhile are freed."""
        fut = self.core.allocate(num_blocks, wait)
        try:
            block_ids = await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            if not self.core.cancel_allocation(fut):
                fut.add_done_callback(self._free_if_allocated)
            raise
        return OwnedBlocks(block_ids, self.core)

    async def match_prefix(self, token_ids: list[int]) -> OwnedBlocks:
        """One reference on each KV block of the longest prefix of ``token_ids`` held by the prefix cache (full blocks
        only: at most ``len(token_ids) // block_size``), owned by the caller; empty without a prefix cache. The blocks
        hold the K/V of the first ``len(result) * block_size`` tokens. Cancel-safe (blocks taken meanwhile are freed)."""
        bm = self.block_manager
        if not isinstance(bm, PrefixCachingBlockManager):
            return OwnedBlocks([], self.core)
        keys = bm.keys(token_ids)  # hashed here, off the engine thread
        fut = self.core.call(lambda: bm.match(keys))
        try:
            block_ids = await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            fut.add_done_callback(self._free_if_allocated)
            raise
        return OwnedBlocks(block_ids, self.core)

    async def copy_held_rows(self, token_ids: list[int], num_full_blocks: int, dst_block_id: int) -> int:
        """Copy-on-write of a partial block held by the prefix cache: when one is keyed after the full blocks of
        ``token_ids[: num_full_blocks * block_size]`` with tokens that the rest of ``token_ids`` starts with (r of
        them, 0 < r < block_size), copy its token rows ``[0, r)`` into ``dst_block_id`` (a block the caller owns
        and nobody else writes) and return r; otherwise 0 (also without a prefix cache). The cached block stays as
        it was."""
        bm = self.block_manager
        if not isinstance(bm, PrefixCachingBlockManager):
            return 0
        bs = bm.block_size
        full = token_ids[: num_full_blocks * bs]
        parent = bm.keys(full)[-1] if num_full_blocks else bm.root  # hashed here, off the engine thread
        following = token_ids[num_full_blocks * bs : (num_full_blocks + 1) * bs]

        def copy() -> int:
            held = bm.match_partial(parent, following)
            if held is None:
                return 0
            try:
                self.core.runner.copy_block_rows(held[0], dst_block_id, held[1])
            finally:
                bm.free([held[0]])
            return held[1]

        return await asyncio.wrap_future(self.core.call(copy))

    def _free_if_allocated(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.core.free(fut.result())

    async def stats(self, *, wait_for_step: bool = True) -> dict[str, float]:
        """Engine counters (KV blocks, requests running and waiting, steps, tokens, prefix cache).

        ``wait_for_step=True`` reads them on the engine thread between steps, after every command queued before
        (a free, an incref): one consistent reading, which can take as long as the step in progress.
        ``wait_for_step=False`` reads them now on the caller's thread, for GetStats: a step may last seconds (a
        long prefill, a slow machine), and a poll that waited for it would miss the router's deadline and take a
        busy, healthy worker out of rotation. Each value is then a ``len()`` or an int the engine thread updates
        whole (atomic under the GIL): at most one step or queued command stale, never torn.
        """
        def read() -> dict[str, float]:
            return {
                "kv_blocks_total": self.block_manager.num_blocks,
                "kv_blocks_free": self.block_manager.num_free,
                "requests_running": len(self.core.scheduler.running) + self.core.scheduler.num_prefilling,
                "requests_waiting": len(self.core.scheduler.waiting),
                "kv_allocations_waiting": len(self.core.admission.waiters),
                "queue_refused": self.core.admission.num_refused,
                "queue_timeouts": self.core.admission.num_timed_out,
                "kv_block_waits": self.core.admission.num_block_waits + self.core.scheduler.num_block_waits,
                "engine_steps": self.core.num_steps,
                "prefill_tokens": self.core.num_prefill_tokens,
                "decode_tokens": self.core.num_decode_tokens,
                **self._prefix_cache_stats(),
            }

        if not wait_for_step:
            return read()
        return await asyncio.wrap_future(self.core.call(read))

    def _prefix_cache_stats(self) -> dict[str, float]:
        """Prefix cache counters: blocks cached (evictable), looked up, hit, evicted."""
        bm = self.block_manager
        if not isinstance(bm, PrefixCachingBlockManager):
            return {}
        return {"kv_blocks_cached": bm.num_cached, "prefix_cache_queried_blocks": bm.num_queried_blocks,
                "prefix_cache_hit_blocks": bm.num_hit_blocks, "prefix_cache_evicted_blocks": bm.num_evicted}


def set_torch_threads(n: int, pinned: set[int] | None = None, *, owns_machine: bool = False) -> int:
    """Set torch's intra-op threads (``--torch-threads``) and return how many.

    ``n`` > 0 is taken as given; 0 (auto) means one thread per pinned CPU (``pinned``, from ``--cpus``), or,
    unpinned, every CPU this process may run on when it ``owns_machine`` (``colocated``) and 1 otherwise (a
    worker that shares the machine with other workers).
    """
    if n <= 0:
        n = len(pinned) if pinned else (len(os.sched_getaffinity(0)) if owns_machine else 1)
    torch.set_num_threads(n)
    return n
