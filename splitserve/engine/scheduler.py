"""Continuous-batching scheduler (plain Python, no torch).

Default (unchunked): each step is either a prefill batch (waiting requests, packed up to
``max_num_batched_tokens``) or a decode batch (every running request, one token each). Prefill goes
first, as in vLLM's v0 scheduler and nano-vllm; new requests therefore join the running batch
between steps and finished ones leave and free their KV blocks. When the KV pool runs out during
decode the most recently admitted request is preempted (blocks freed, recomputed later).

Chunked prefill (``chunked_prefill=True``, Sarathi-Serve's stall-free batching): every step carries
every running decode (one token each; a decode is never left out for a prompt) plus prompt chunks
filling the rest of the ``max_num_batched_tokens`` budget: first the next chunk of the prompt already
being prefilled, then waiting prompts in FCFS order. Only the last prompt of a step can stop short of
its end, so at most one prompt is partly prefilled at a time. A long prompt therefore shares each
step with the running decodes instead of stalling them for its whole prefill, and a step's new
tokens never exceed the budget unless the running decodes alone do. KV blocks for the whole prompt
are reserved at admission, as in the unchunked path, so a chunked prompt never has to be preempted
for its own blocks. A step that ends a prompt's last chunk samples its first token; earlier chunks
sample nothing.

Waiting requests are admitted in FIFO order as long as their blocks are free; one that does not fit waits
(blocks held elsewhere come back with a free: see ``splitserve.engine.admission``). Admissions leave
``reserved_blocks`` free for a waiting block allocation. Prefix blocks that requests behind the head hold
while they wait (loaded from the KV store) are given up when that lets the head start, so waiting requests
never hold each other's blocks forever.

With a prefix cache (``engine.prefix_cache.PrefixCachingBlockManager``) a waiting request without blocks first takes
the cached blocks of its longest cached prefix at admission (those tokens count as computed), and every step keys the
blocks it filled, so they stay reusable after the request ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.prefix_cache import PrefixCachingBlockManager
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence, SeqMode, SeqStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64  # most requests in one decode batch
    max_num_batched_tokens: int = 4096  # most prompt tokens in one prefill batch
    max_model_len: int = 512  # prompt + output tokens
    chunked_prefill: bool = False  # mix decodes and prompt chunks in one step (token budget above)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_prefilling = 0  # admitted to the step in progress, in neither queue until it ends (unchunked)
        self.reserved_blocks = 0  # promised to a waiting block allocation: admissions leave them free
        self.num_block_waits = 0  # requests that found too few free KV blocks at the head of the queue
        self.prefix_cache = block_manager if isinstance(block_manager, PrefixCachingBlockManager) else None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, seq: Sequence) -> int:
        """KV blocks ``seq`` needs on top of its block table to feed all its tokens."""
        bs = self.config.block_size
        return max(0, -(-seq.num_tokens // bs) - len(seq.block_table))

    def add(self, seq: Sequence) -> None:
        if seq.mode is SeqMode.DECODE_PREFILLED:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request -- every sequence of it: the choices of an n > 1 request share the request_id -- and
        free their KV blocks; returns the first one removed, or None if unknown."""
        removed = [seq for queue in (self.waiting, self.running) for seq in queue if seq.request_id == request_id]
        for seq in removed:
            (self.waiting if seq in self.waiting else self.running).remove(seq)
            self._release(seq, "abort")
        return removed[0] if removed else None

    def _release(self, seq: Sequence, finish_reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = finish_reason
        if seq.block_table:
            self.block_manager.free(seq.block_table)
            seq.block_table = []

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next batch; returns (sequences, has_prefill_tokens).

        With chunked prefill a batch may mix decodes and prompt chunks; each sequence's
        ``num_scheduled_tokens`` then says how many of its new tokens this step feeds.
        """
        self.num_prefilling = 0  # the engine core clears it again once the step's forward is over
        if self.config.chunked_prefill:
            return self._schedule_chunked()
        batch: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if batch and num_tokens + seq.num_new_tokens > self.config.max_num_batched_tokens:
                break
            if not self._can_admit(seq):
                break
            self._admit(seq)
            batch.append(seq)
            num_tokens += seq.num_new_tokens
        if batch:
            self.num_prefilling = len(batch)
            return batch, True
        return self._schedule_decode(), False

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        pending = list(self.running)
        while pending:
            seq = pending.pop(0)
            if not self._grow_or_preempt(seq, pending):
                continue
            scheduled.append(seq)
        return scheduled

    def _grow_or_preempt(self, seq: Sequence, pending: list[Sequence]) -> bool:
        """Give running ``seq`` the blocks its next step needs, preempting the most recent of ``pending`` (popped
        from its end) until they fit; if they still do not fit, preempt ``seq`` itself. Returns True when grown."""
        need = self.blocks_needed(seq)
        while not self.block_manager.can_allocate(need) and pending:
            self._preempt(pending.pop())
        if not self.block_manager.can_allocate(need):
            self._preempt(seq)
            return False
        seq.block_table += self.block_manager.allocate(need)
        return True

    def _schedule_chunked(self) -> tuple[list[Sequence], bool]:
        decodes = [s for s in self.running if s.num_new_tokens == 1]
        prompts = [s for s in self.running if s.num_new_tokens > 1]  # the partly prefilled prompt (FCFS order)
        scheduled: list[Sequence] = []
        pending = decodes + prompts  # _grow_or_preempt preempts from the end: the prompt chunk before any decode
        while pending:
            seq = pending.pop(0)
            if self._grow_or_preempt(seq, pending):
                seq.num_scheduled_tokens = 0
                scheduled.append(seq)
        budget = self.config.max_num_batched_tokens - sum(s.num_new_tokens == 1 for s in scheduled)
        chunks: list[Sequence] = []
        for seq in scheduled:
            if seq.num_new_tokens > 1:
                if budget <= 0:
                    continue  # no room left after the decodes: this prompt waits (its blocks stay reserved)
                seq.num_scheduled_tokens = min(seq.num_new_tokens, budget)
                budget -= seq.num_scheduled_tokens
            chunks.append(seq)
        scheduled = chunks
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._can_admit(seq):
                break
            self._admit(seq)
            seq.num_scheduled_tokens = min(seq.num_new_tokens, budget)
            self.running.append(seq)
            scheduled.append(seq)
            budget -= seq.num_scheduled_tokens
        has_prefill = any(s.num_computed_tokens < len(s.prompt_token_ids) for s in scheduled)
        return scheduled, has_prefill

    def _can_admit(self, seq: Sequence) -> bool:
        """Whether the head of ``waiting`` can get its blocks now (leaving ``reserved_blocks`` free). With a prefix
        cache it first takes the cached blocks of the longest cached prefix (unless every prompt position must be
        computed for its logprobs)."""
        if self.prefix_cache is not None and seq.params.prompt_logprobs is None:
            self.prefix_cache.reuse_prefix(seq)
        need = self.blocks_needed(seq) + self.reserved_blocks
        if self.block_manager.can_allocate(need):
            return True
        behind = [s for s in self.waiting if s is not seq and s.block_table]
        if behind and self.block_manager.num_free + sum(len(s.block_table) for s in behind) >= need:
            for other in reversed(behind):  # the latest arrivals give up their prefix blocks first; they recompute it
                self.block_manager.free(other.block_table)
                other.block_table = []
                other.num_computed_tokens = other.cached_tokens = 0
                if self.block_manager.can_allocate(need):
                    return True
        if not seq.waited_for_blocks:  # held elsewhere (running, leases, transfers, store writes): wait for a free
            seq.waited_for_blocks = True
            self.num_block_waits += 1
        return False

    def _admit(self, seq: Sequence) -> None:
        self.waiting.popleft()
        seq.block_table += self.block_manager.allocate(self.blocks_needed(seq))
        seq.status = SeqStatus.RUNNING
        seq.queued_at = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_scheduled_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append sampled tokens, apply stop rules, free finished requests; returns the finished ones.

        A finished PREFILL_ONLY sequence keeps its blocks: ownership passes to the caller. A
        partial prefill chunk only advances ``num_computed_tokens`` (its sampled token is dropped).
        """
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            if seq.is_partial_prefill:
                seq.num_computed_tokens += seq.num_step_tokens
                seq.num_scheduled_tokens = 0
                self._cache_computed(seq)
                continue
            seq.num_scheduled_tokens = 0
            seq.num_computed_tokens = seq.num_tokens
            self._cache_computed(seq)
            seq.output_token_ids.append(token_id)
            reason = self.stop_reason(seq.params, token_id, len(seq.output_token_ids), seq.num_tokens)
            if seq.mode is SeqMode.PREFILL_ONLY:
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = reason
                self.running.remove(seq) if seq in self.running else None
                finished.append(seq)
                continue
            if seq not in self.running:
                self.running.append(seq)
            if reason is not None:
                self.running.remove(seq)
                if self.prefix_cache is not None:  # its partly filled last block stays reusable
                    self.prefix_cache.cache_partial(seq)
                self._release(seq, reason)
                finished.append(seq)
        return finished

    def _cache_computed(self, seq: Sequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.cache_computed(seq)

    def stop_reason(self, params: SamplingParams, token_id: int, num_output_tokens: int, num_tokens: int) -> str | None:
        """Why a sequence ends after sampling ``token_id`` (its ``num_output_tokens``-th output token, ``num_tokens``
        with the prompt), or None. A structured-output request stops at EOS even with ``ignore_eos`` (its grammar
        lets EOS through only once the text is complete). Depends on these arguments only, so prefill and decode
        workers agree on which choices end at their first token."""
        p = params
        eos = token_id in self.eos_token_ids and (not p.ignore_eos or p.guided is not None)
        if token_id in p.stop_token_ids or eos:
            return "stop"
        if num_output_tokens >= p.max_tokens or num_tokens >= self.config.max_model_len:
            return "length"
        return None
