"""Engine core: one thread that owns the scheduler, the block manager and the model runner.

Every mutation of engine state happens on this thread. Other threads talk to it through a
command queue (add, abort, allocate, free) and get results through callbacks, so a KV block is
never freed while a forward pass may still write into it.

When nothing can be scheduled (every waiting request or allocation needs blocks held elsewhere) the
thread sleeps until the next command -- a free, an abort, a new request -- or until the next waiter
reaches its queue bound (``splitserve.engine.admission``); it never spins and never fails a request
that fits the pool for lack of free blocks right now.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from splitserve.engine.admission import Admission
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampler import SampleResult
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SeqMode
from splitserve.errors import InvalidRequest, PdError, WorkerUnavailable

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request after a step.

    ``block_ids`` is set only for a finished PREFILL_ONLY request without finish_reason: the
    caller now owns those KV blocks and must free them (``EngineCore.free``).

    ``index`` is the choice (n > 1 requests stream every choice under one request_id; each ends with its
    own finish_reason). ``logprobs`` (one per token of ``token_ids``) and ``prompt_logprobs`` (first output
    of a request only) are set when the request's SamplingParams ask for them.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    block_ids: list[int] | None = None
    cached_tokens: int = 0
    error: Exception | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class EngineCore:
    """Args: ``max_queue_len`` / ``max_queue_wait_s`` bound the waiting queues (see ``Admission``);
    ``clock`` (monotonic seconds) measures the waits."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, emit: Callable[[list[RequestOutput]], None],
                 max_queue_len: int = 1024, max_queue_wait_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.admission = Admission(scheduler, max_queue_len, max_queue_wait_s, clock)
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

    def allocate(self, num_blocks: int, wait: bool = True) -> concurrent.futures.Future:
        """Future of ``num_blocks`` block ids. With ``wait`` it waits (FIFO, bounded) until they are free;
        without, it fails at once with CapacityExhausted when they are not. InvalidRequest if more than the
        pool. Give up with :meth:`cancel_allocation`."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("allocate", (num_blocks, fut, wait)))
        return fut

    def cancel_allocation(self, fut: concurrent.futures.Future) -> bool:
        """True when the allocation was cancelled before it got blocks (nothing to free); False when it
        already has them (or an error): the caller frees what the future holds."""
        if fut.cancel():
            self.wake()  # the engine drops it from the queue and stops reserving blocks for it
            return True
        return False

    def wake(self) -> None:
        """Make a sleeping engine thread take one turn."""
        self._commands.put(("wake", None))

    def free(self, block_ids: list[int]) -> None:
        self._commands.put(("free", list(block_ids)))

    def fork(self, children: list[Sequence], block_ids: list[int], copies: list[int]) -> None:
        """Start the choices of an n > 1 request over one prompt's KV: ``children`` (DECODE_PREFILLED, same
        request_id, ``num_computed_tokens`` set) share ``block_ids``' full computed blocks (one reference each);
        the first child takes the remaining (partial) blocks, every other child gets a copy of them in its
        own slice of ``copies`` (copy-on-write at fork). Takes ownership of ``block_ids`` and ``copies``."""
        self._commands.put(("fork", (children, list(block_ids), list(copies))))

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
        stalled = True
        while not self._stopped:
            try:
                stalled = self.run_once(stalled)
            except Exception:  # keep serving: a failed step fails its requests, not the worker
                logger.exception("engine step failed")
                self._fail_all()
        self.admission.fail_all(WorkerUnavailable("the engine stopped"))

    def run_once(self, stalled: bool) -> bool:
        """One turn of the engine thread: apply commands, expire and serve waiters, run one step. Returns
        whether it is stalled (nothing could be scheduled). When the previous turn stalled, or there is no
        work, it first sleeps until a command arrives or the next waiter's bound is due -- it never spins.
        (Tests call it directly with a fake runner, queued commands and an injected clock.)"""
        block = stalled or not self.scheduler.has_work()
        self._drain(block, self.admission.timeout() if block else None)
        if self._stopped:
            return True
        self._expire()
        self.admission.serve()
        return not self._step() if self.scheduler.has_work() else True

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = self._commands.get(block=block, timeout=timeout)
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
            try:
                self.admission.enqueue(arg)
            except PdError as exc:  # can never fit, or the queue is full
                self._refuse(arg, exc)
        elif kind == "wake":
            pass
        elif kind == "abort":
            self.scheduler.abort(arg)
        elif kind == "free":
            self.block_manager.free(arg)
        elif kind == "fork":
            self._fork(*arg)
        elif kind == "incref":
            self.block_manager.incref(arg)
        elif kind == "allocate":
            self.admission.allocate(*arg)
        elif kind == "call":
            fn, fut = arg
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _fork(self, children: list[Sequence], block_ids: list[int], copies: list[int]) -> None:
        shared = children[0].num_computed_tokens // self.runner.block_size
        tail = block_ids[shared:]
        children[0].block_table = block_ids
        for j, child in enumerate(children[1:]):
            own = copies[j * len(tail) : (j + 1) * len(tail)]
            self.runner.copy_blocks(tail, own)
            self.block_manager.incref(block_ids[:shared])
            child.block_table = block_ids[:shared] + own
        try:
            for child in children:  # DECODE_PREFILLED: only the fit check, the same for every child
                self.admission.enqueue(child)
        except PdError as exc:
            for child in children:
                self.scheduler.abort(child.request_id)
                if child.block_table:
                    self.block_manager.free(child.block_table)
                    child.block_table = []
            self._emit([RequestOutput(children[0].request_id, [], "abort", error=exc)])

    def _step(self) -> bool:
        """One batch; False when nothing could be scheduled (everything waits for blocks held elsewhere)."""
        seqs, _ = self.scheduler.schedule()
        if not seqs:
            return False
        num_prefill = sum(s.num_step_tokens for s in seqs if s.num_computed_tokens < len(s.prompt_token_ids))
        num_decode = sum(s.num_step_tokens for s in seqs) - num_prefill
        try:
            token_ids = self.runner.execute(seqs)
        except Exception as exc:
            logger.exception("forward pass failed for %d requests", len(seqs))
            self._fail(seqs, exc)
            return True
        finally:
            self.scheduler.num_prefilling = 0  # the step's prompts go to running (or fail) next
        self.num_steps += 1
        self.num_prefill_tokens += num_prefill
        self.num_decode_tokens += num_decode
        for reject in (self._fail_unsampleable, self._advance_matchers):  # failed requests leave the step
            rejected = reject(seqs, token_ids)
            if rejected:
                keep = [i for i, s in enumerate(seqs) if s.request_id not in rejected]
                seqs, token_ids = [seqs[i] for i in keep], [token_ids[i] for i in keep]
        sampled = [(s, t) for s, t in zip(seqs, token_ids) if not s.is_partial_prefill]  # chunks sample nothing
        finished = {id(s) for s in self.scheduler.postprocess(seqs, token_ids)}
        outputs = []
        for seq, token_id in sampled:
            results, seq.step_results = seq.step_results, None
            if seq.mode is SeqMode.PREFILL_ONLY:
                outputs += self._prefill_outputs(seq, results or [SampleResult(token_id)])
                continue
            done = id(seq) in finished
            out = RequestOutput(seq.request_id, [token_id], seq.finish_reason if done else None,
                                cached_tokens=seq.cached_tokens, index=seq.index)
            if results and results[0].logprob is not None:
                out.logprobs = [results[0].logprob]
            if len(seq.output_token_ids) == 1 and seq.mode is SeqMode.GENERATE:
                out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)
        self._emit(outputs)
        return True

    def _fail_unsampleable(self, seqs: list[Sequence], token_ids: list[int]) -> set[str]:
        """Fail (InvalidRequest) the requests whose sampling constraints left no possible token this step (e.g.
        ``allowed_token_ids`` outside a grammar); returns their request_ids. The rest of the batch goes on."""
        bad = {s.request_id: (s, r.error) for s in seqs for r in (s.step_results or ()) if r.error is not None}
        for seq, error in bad.values():
            logger.info("request %s: %s", seq.request_id, error)
            self._fail([seq], InvalidRequest(error))
        return set(bad)

    def _advance_matchers(self, seqs: list[Sequence], token_ids: list[int]) -> set[str]:
        """Advance each sampled sequence's grammar matcher over its token; returns the request_ids whose matcher
        refused it (the mask should make that impossible: an internal error), after aborting them. A
        PREFILL_ONLY sequence's matcher only masks (its choices decode elsewhere, each with its own matcher)."""
        bad: dict[str, Sequence] = {}
        for seq, token_id in zip(seqs, token_ids):
            if seq.matcher is None or seq.is_partial_prefill or seq.mode is SeqMode.PREFILL_ONLY:
                continue
            if not seq.matcher.accept(token_id):
                logger.error("request %s choice %d: the grammar matcher refused token %d that its mask allowed",
                             seq.request_id, seq.index, token_id)
                bad.setdefault(seq.request_id, seq)
        if bad:
            self._fail(list(bad.values()), RuntimeError("structured output: the grammar refused a sampled token"))
        return set(bad)

    def _prefill_outputs(self, seq: Sequence, results: list[SampleResult]) -> list[RequestOutput]:
        """Outputs of a finished PREFILL_ONLY sequence: one per choice (index i, its first token, finish_reason,
        logprob; prompt_logprobs on index 0). Unless every choice ended at its first token, the last output
        carries the prompt's KV blocks (then owned by the caller); otherwise the blocks are freed here."""
        p, num_tokens = seq.params, len(seq.prompt_token_ids) + 1
        reasons = [seq.finish_reason] + [self.scheduler.stop_reason(p, r.token_id, 1, num_tokens) for r in results[1:]]
        outputs = [RequestOutput(seq.request_id, [r.token_id], reason, cached_tokens=seq.cached_tokens, index=i,
                                 logprobs=None if r.logprob is None else [r.logprob])
                   for i, (r, reason) in enumerate(zip(results, reasons))]
        outputs[0].prompt_logprobs = seq.prompt_logprobs
        if any(reason is None for reason in reasons):
            outputs[-1].block_ids = seq.block_table
            seq.finish_reason = None
        else:
            self.block_manager.free(seq.block_table)
        seq.block_table = []
        return outputs

    def _expire(self) -> None:
        expired = self.admission.expire()
        if expired:
            logger.warning("%d requests waited too long for KV blocks: %s", len(expired), expired[0][1])
            self._emit([RequestOutput(seq.request_id, [], "abort", error=exc) for seq, exc in expired])

    def _refuse(self, seq: Sequence, exc: PdError) -> None:
        """Fail a request that was never queued; blocks it brought (e.g. prefix blocks from the KV store) are freed."""
        if seq.block_table:
            self.block_manager.free(seq.block_table)
            seq.block_table = []
        self._emit([RequestOutput(seq.request_id, [], "abort", error=exc)])

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        for seq in seqs:
            if self.scheduler.abort(seq.request_id) is None and seq.block_table:  # (aborts every choice of it)
                self.block_manager.free(seq.block_table)  # was in flight: in neither queue
                seq.block_table = []
        self._emit([RequestOutput(s.request_id, [], "abort", error=exc) for s in seqs])

    def _fail_all(self) -> None:
        seqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        self._fail(seqs, RuntimeError("engine step failed"))
