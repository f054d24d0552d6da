"""Admission to the KV pool: what a request can ever need, and who waits for free blocks (plain Python, no torch).

Blocks are often held outside the scheduler for a while: by KV leases waiting for a decode worker's pull,
by KV-store writes in flight (one extra reference each), by allocations being filled by a transfer. They
come back with a ``free``. A request that fits the pool but not the blocks free right now therefore waits
instead of failing, in one of two FIFO queues:

* requests (Sequences) in the scheduler's ``waiting`` queue: the scheduler allocates their blocks when it
  admits them;
* block allocations (:class:`BlockWaiter`, e.g. a decode worker's blocks for incoming KV). The head
  allocation goes first: while it waits, new admissions leave its blocks free
  (``Scheduler.reserved_blocks``), so a stream of small prompts cannot starve it; running requests keep
  growing (they finish and free their blocks).

Bounds (both CapacityExhausted: RESOURCE_EXHAUSTED, HTTP 503 with Retry-After; the router may try another
worker): a request or allocation that would make more than ``max_queue_len`` wait is refused at once, and one
still waiting after ``max_queue_wait_s`` (on the injected clock) fails. A request that can never fit -- more
blocks than the whole pool -- is refused before it queues with InvalidRequest (INVALID_ARGUMENT, HTTP 400).
A caller that goes away while waiting (abort, cancelled allocation) leaves nothing allocated.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SeqMode
from splitserve.errors import CapacityExhausted, InvalidRequest


def max_blocks(num_prompt_tokens: int, max_tokens: int, block_size: int, max_model_len: int, prefill_only: bool) -> int:
    """Most KV blocks one request ever holds.

    A prefill holds its prompt's blocks. A generation feeds every token but the last sampled one, so it holds
    ``num_prompt_tokens + max_tokens - 1`` tokens at most, and never more than ``max_model_len - 1`` (where
    it stops with "length"); a preempted request is recomputed within the same bound.
    """
    n = num_prompt_tokens
    if not prefill_only:
        n = max(n, min(num_prompt_tokens + max_tokens, max_model_len) - 1)
    return -(-n // block_size)


def check_fits(num_prompt_tokens: int, max_tokens: int, block_size: int, max_model_len: int, num_blocks: int,
               prefill_only: bool) -> None:
    """Raises InvalidRequest when the request needs more KV blocks than the whole pool (it could never run)."""
    need = max_blocks(num_prompt_tokens, max_tokens, block_size, max_model_len, prefill_only)
    if need > num_blocks:
        what = f"its prompt ({num_prompt_tokens} tokens)" if prefill_only else (
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens})")
        raise InvalidRequest(
            f"{what} needs {need} KV blocks of {block_size} tokens; this worker's whole KV pool has {num_blocks} "
            f"({num_blocks * block_size} tokens)"
        )


@dataclass(slots=True)
class BlockWaiter:
    """One allocation waiting for ``num_blocks`` free blocks; ``future`` gets the block ids or an error."""

    num_blocks: int
    future: concurrent.futures.Future
    queued_at: float


class Admission:
    """Queue bounds and the block-allocation queue of one engine (used on the engine thread only).

    Args:
        scheduler: its ``waiting`` queue and block manager.
        max_queue_len: most requests + allocations waiting at once.
        max_queue_wait_s: longest wait in either queue (``math.inf``: unbounded).
        clock: seconds, monotonic (injected in tests).
    """

    def __init__(self, scheduler: Scheduler, max_queue_len: int, max_queue_wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_queue_len < 1 or not max_queue_wait_s > 0:
            raise ValueError(f"max_queue_len must be >= 1 and max_queue_wait_s > 0, got {max_queue_len}, {max_queue_wait_s}")
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.max_queue_len = max_queue_len
        self.max_queue_wait_s = max_queue_wait_s
        self.clock = clock
        self.waiters: deque[BlockWaiter] = deque()
        self.num_refused = 0  # queue full
        self.num_timed_out = 0  # waited max_queue_wait_s
        self.num_block_waits = 0  # allocations that could not be served at once

    def __len__(self) -> int:
        """Requests and allocations waiting now."""
        return len(self.scheduler.waiting) + len(self.waiters)

    # --- requests ----------------------------------------------------------------------------------------
    def enqueue(self, seq: Sequence) -> None:
        """Hand ``seq`` to the scheduler (a DECODE_PREFILLED one holds its blocks already and runs at once).

        Raises:
            InvalidRequest: it can never fit the pool (nothing was queued; its blocks are the caller's).
            CapacityExhausted: the queue is full.
        """
        cfg = self.scheduler.config
        check_fits(len(seq.prompt_token_ids), seq.params.max_tokens, cfg.block_size, cfg.max_model_len,
                   self.block_manager.num_blocks, seq.mode is SeqMode.PREFILL_ONLY)
        if seq.mode is not SeqMode.DECODE_PREFILLED:
            self._check_room(f"request {seq.request_id}")
            seq.queued_at = self.clock()
        self.scheduler.add(seq)

    def _check_room(self, what: str) -> None:
        if len(self) >= self.max_queue_len:
            self.num_refused += 1
            raise CapacityExhausted(f"{what}: {len(self)} requests already wait for KV blocks or a batch slot "
                                    f"(max_queue_len {self.max_queue_len}); try again later")

    # --- block allocations -------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, future: concurrent.futures.Future, wait: bool) -> None:
        """Resolve ``future`` with ``num_blocks`` block ids now, or queue it (``wait``) until they are free.
        Without ``wait`` it fails at once (CapacityExhausted) unless the blocks are free and nobody waits."""
        if future.cancelled():
            return  # the caller gave up: allocate nothing
        try:
            if num_blocks > self.block_manager.num_blocks:
                raise InvalidRequest(f"{num_blocks} KV blocks requested; this worker's whole KV pool has {self.block_manager.num_blocks}")
            if not wait:
                if self.waiters or not self.block_manager.can_allocate(num_blocks):
                    raise CapacityExhausted(f"{num_blocks} KV blocks are not free now "
                                            f"({self.block_manager.num_free} free of {self.block_manager.num_blocks})")
                if future.set_running_or_notify_cancel():
                    future.set_result(self.block_manager.allocate(num_blocks))
                return
            self._check_room(f"allocation of {num_blocks} KV blocks")
        except Exception as exc:
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)
            return
        self.waiters.append(BlockWaiter(num_blocks, future, self.clock()))
        self.serve()
        if not future.done():
            self.num_block_waits += 1

    def serve(self) -> None:
        """Give free blocks to waiting allocations, in order; then reserve the head's blocks from admissions."""
        if any(w.future.cancelled() for w in self.waiters):  # callers that went away leave the queue
            self.waiters = deque(w for w in self.waiters if not w.future.cancelled())
        while self.waiters:
            head = self.waiters[0]
            if not self.block_manager.can_allocate(head.num_blocks):
                break
            self.waiters.popleft()
            if head.future.set_running_or_notify_cancel():
                head.future.set_result(self.block_manager.allocate(head.num_blocks))
        self.scheduler.reserved_blocks = self.waiters[0].num_blocks if self.waiters else 0

    # --- bounds ------------------------------------------------------------------------------------------
    def expire(self) -> list[tuple[Sequence, CapacityExhausted]]:
        """Fail what waited ``max_queue_wait_s``: allocations get the error on their future; requests are
        removed from the queue with their blocks freed and returned with their error (the caller emits it).

        Both queues are in arrival order (preempted requests, at the front of ``waiting``, have no
        ``queued_at``), so only the expired ones at the front are looked at: cheap on every engine turn."""
        now = self.clock()
        limit = self.max_queue_wait_s
        while self.waiters and now - self.waiters[0].queued_at >= limit:
            w = self.waiters.popleft()
            if w.future.set_running_or_notify_cancel():
                self.num_timed_out += 1
                w.future.set_exception(CapacityExhausted(
                    f"allocation of {w.num_blocks} KV blocks waited {now - w.queued_at:.1f} s (max_queue_wait_s); "
                    f"{self._pool()}; try again later"))
        expired = []
        for seq in self._queued():
            if now - seq.queued_at < limit:
                break
            expired.append(seq)
        out = []
        for seq in expired:
            msg = (f"request {seq.request_id} waited {now - seq.queued_at:.1f} s (max_queue_wait_s) in the queue: "
                   f"needs {self.scheduler.blocks_needed(seq)} more KV blocks; {self._pool()}; try again later")
            self.scheduler.abort(seq.request_id)
            self.num_timed_out += 1
            out.append((seq, CapacityExhausted(msg)))
        self.serve()
        return out

    def _queued(self):
        """Waiting requests that have a ``queued_at`` (not preempted ones), oldest first."""
        return (s for s in self.scheduler.waiting if s.queued_at is not None)

    def _pool(self) -> str:
        bm = self.block_manager
        return (f"{bm.num_free} of {bm.num_blocks} blocks free, {len(self.scheduler.running)} requests running, "
                f"{len(self)} waiting")

    def timeout(self) -> float | None:
        """Seconds until the next waiter times out (0 if one is due), or None when nothing can time out."""
        if math.isinf(self.max_queue_wait_s):
            return None
        oldest = [self.waiters[0].queued_at] if self.waiters else []
        oldest += [s.queued_at for s in itertools.islice(self._queued(), 1)]
        if not oldest:
            return None
        return max(0.0, min(oldest) + self.max_queue_wait_s - self.clock())

    def fail_all(self, exc: Exception) -> None:
        """Fail every waiting allocation (the engine stops)."""
        while self.waiters:
            w = self.waiters.popleft()
            if w.future.set_running_or_notify_cancel():
                w.future.set_exception(exc)
        self.scheduler.reserved_blocks = 0
