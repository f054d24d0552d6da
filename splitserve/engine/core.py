"""Engine core: one thread that owns the scheduler, the block manager and the model runner.

Every mutation of engine state happens on this thread. Other threads talk to it through a
command queue (add, abort, allocate, free) and get results through callbacks, so a KV block is
never freed while a forward pass may still write into it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.runner import ModelRunner
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SeqMode

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request after a step.

    ``block_ids`` is set only for a finished PREFILL_ONLY request without finish_reason: the
    caller now owns those KV blocks and must free them (``EngineCore.free``).
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    block_ids: list[int] | None = None
    cached_tokens: int = 0
    error: Exception | None = None


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, emit: Callable[[list[RequestOutput]], None]) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self._emit = emit
        self._commands: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._stopped = False
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    # --- commands (any thread) -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._commands.put(("add", seq))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def allocate(self, num_blocks: int) -> concurrent.futures.Future:
        """Future of ``num_blocks`` block ids (CapacityExhausted if the pool is short)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("allocate", (num_blocks, fut)))
        return fut

    def free(self, block_ids: list[int]) -> None:
        self._commands.put(("free", list(block_ids)))

    def incref(self, block_ids: list[int]) -> None:
        """Take one more reference on allocated blocks (commands apply in order, so an incref queued
        before a free always takes effect first); drop it with :meth:`free`."""
        self._commands.put(("incref", list(block_ids)))

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread (e.g. to read counters consistently)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, fut)))
        return fut

    # --- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            try:
                self._drain(block=not self.scheduler.has_work())
                if self._stopped:
                    break
                if self.scheduler.has_work():
                    self._step()
            except Exception:  # keep serving: a failed step fails its requests, not the worker
                logger.exception("engine step failed")
                self._fail_all()

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(block=block, timeout=None)
        except queue.Empty:
            return
        while item is not None:
            try:
                self._apply(item)
            except Exception:  # a bad command (e.g. a double free) is that caller's bug, not every request's
                logger.exception("engine command %s failed", item[0])
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
        self._stopped = True

    def _apply(self, item: tuple) -> None:
        kind, arg = item
        if kind == "add":
            self.scheduler.add(arg)
        elif kind == "abort":
            self.scheduler.abort(arg)
        elif kind == "free":
            self.block_manager.free(arg)
        elif kind == "incref":
            self.block_manager.incref(arg)
        elif kind == "allocate":
            num_blocks, fut = arg
            if not fut.set_running_or_notify_cancel():  # the caller gave up: allocate nothing
                return
            try:
                fut.set_result(self.block_manager.allocate(num_blocks))
            except Exception as exc:
                fut.set_exception(exc)
        elif kind == "call":
            fn, fut = arg
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _step(self) -> None:
        seqs, _ = self.scheduler.schedule()
        if not seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                self._reject_unschedulable()
            return
        num_prefill = sum(s.num_step_tokens for s in seqs if s.num_computed_tokens < len(s.prompt_token_ids))
        num_decode = sum(s.num_step_tokens for s in seqs) - num_prefill
        try:
            token_ids = self.runner.execute(seqs)
        except Exception as exc:
            logger.exception("forward pass failed for %d requests", len(seqs))
            self._fail(seqs, exc)
            return
        self.num_steps += 1
        self.num_prefill_tokens += num_prefill
        self.num_decode_tokens += num_decode
        sampled = [(s, t) for s, t in zip(seqs, token_ids) if not s.is_partial_prefill]  # chunks sample nothing
        finished = {id(s) for s in self.scheduler.postprocess(seqs, token_ids)}
        outputs = []
        for seq, token_id in sampled:
            done = id(seq) in finished
            out = RequestOutput(seq.request_id, [token_id], seq.finish_reason if done else None, cached_tokens=seq.cached_tokens)
            if done and seq.mode is SeqMode.PREFILL_ONLY:
                if seq.finish_reason is None:
                    out.block_ids = seq.block_table
                else:
                    self.block_manager.free(seq.block_table)
                seq.block_table = []
            outputs.append(out)
        self._emit(outputs)

    def _reject_unschedulable(self) -> None:
        from splitserve.errors import CapacityExhausted

        seq = self.scheduler.waiting.popleft()
        if seq.block_table:  # e.g. prefix blocks loaded from the KV store
            self.block_manager.free(seq.block_table)
            seq.block_table = []
        msg = f"request {seq.request_id} needs more KV blocks than the pool has ({self.block_manager.num_blocks})"
        self._emit([RequestOutput(seq.request_id, [], "abort", error=CapacityExhausted(msg))])

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        for seq in seqs:
            if self.scheduler.abort(seq.request_id) is None and seq.block_table:
                self.block_manager.free(seq.block_table)  # was in flight: in neither queue
                seq.block_table = []
        self._emit([RequestOutput(s.request_id, [], "abort", error=exc) for s in seqs])

    def _fail_all(self) -> None:
        seqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        self._fail(seqs, RuntimeError("engine step failed"))
