"""Conditional disaggregation: prefill on a prefill worker (KV handoff) or locally on the decode worker.

Modes (``--disagg``):

* ``always``: every request is prefilled remotely (the classic PD split; the default).
* ``N`` (an integer): fixed threshold -- a request with fewer than N *uncached* prompt tokens is
  prefilled locally on the decode worker; longer ones go to a prefill worker.
* ``auto``: the threshold is the crossover of two measured linear cost models, refreshed per request::

      local(n)  = W_d + o_d + a_d * n * (1 + beta * R_d)
      remote(n) = W_p + o_p + a_p * n + o_x + s_x * n
      threshold = (W_p + o_p + o_x - o_d - W_d) / (a_d * (1 + beta * R_d) - a_p - s_x)

  ``n`` uncached prompt tokens. ``a_p, o_p``: prefill seconds/token and fixed overhead on a prefill worker, fitted
  to the *service* times of Prefill RPCs (from the later of the call's start and the end of the calls ahead of it),
  not to their waits in the queue. ``W_p``: the expected wait at the chosen prefill worker -- every
  Prefill call this router sent there and has not seen answered, each queued after the one before at its predicted
  service time (:class:`PrefillQueue`; FIFO, as a prefill worker admits them). ``a_d, o_d, W_d``: the same for local
  prefill on the decode worker (time from the Decode call to the first streamed token, service times as above:
  the wait for the running step included, which a remote prefill does not pay; ``W_d`` the local
  prefills this router sent there whose first token has not come back). ``s_x, o_x``: the KV handoff, fitted to the pull times the
  decode worker reports (``DecodeResponse.kv_transfer_us``). ``R_d``: requests running on the decode worker, each
  stalled for the length of a local prefill (``beta`` weighs that interference against the request's own TTFT).
  A non-positive denominator means local prefill costs no more per token: the threshold is ``max_threshold``,
  or 0 when local prefill starts further behind (a negative numerator: its queue and overhead exceed remote's).
  Whatever the crossover, a local prefill may stall the running decodes for at most ``max_local_stall_s``
  (``--disagg-max-stall-ms``): the threshold is capped at ``max_local_stall_s / a_d``. The sum above weighs a
  stall by ``beta`` per running request; the cap keeps a long document off the decode worker even when every
  prefill worker is busy, since its stall (every running stream's ITL at once) is what ITL p99 SLOs see.

  So a short prompt goes to an idle prefill worker (its TTFT there has no decode step to wait for, and the running
  decodes are not stalled) but stays on the decode worker while the prefill worker works through a long document.

Until a model has ``min_samples`` samples its prior is used (remote and local speed equal, no transfer
cost), so ``auto`` starts by prefilling short prompts locally and learns from there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.telemetry.metrics import (DISAGG_PREFILL_SECONDS_PER_TOKEN, DISAGG_THRESHOLD,
                                          DISAGG_TRANSFER_OVERHEAD, DISAGG_TRANSFER_SECONDS_PER_TOKEN)


class LinearFit:
    """Online least squares ``y = intercept + slope * x`` with exponential forgetting (``decay`` per sample).

    ``anchor_weight`` > 0 adds a pseudo-sample ``(0, prior intercept)`` of that weight that never decays: when the
    samples cluster at one size (a stream of ~1,000-token documents whose times vary by 20%), least squares alone
    turns that noise into any slope and intercept at all; the anchor pins the line's foot until small samples arrive.
    """

    def __init__(self, slope: float, intercept: float, decay: float = 0.97, min_samples: int = 3,
                 anchor_weight: float = 0.0) -> None:
        self.prior = (slope, intercept)
        self.decay, self.min_samples, self.anchor_weight = decay, min_samples, anchor_weight
        self.n = 0
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w = self._w * d + 1
        self._sx, self._sy = self._sx * d + x, self._sy * d + y
        self._sxx, self._sxy = self._sxx * d + x * x, self._sxy * d + x * y
        self.n += 1

    def params(self) -> tuple[float, float]:
        """(slope, intercept), both >= 0; the prior until enough samples."""
        if self.n < self.min_samples:
            return self.prior
        a = self.anchor_weight
        w = self._w + a
        mx, my = self._sx / w, (self._sy + a * self.prior[1]) / w
        var = self._sxx / w - mx * mx
        if var <= 1e-9 * max(mx * mx, 1.0):  # all x equal: no slope information, keep the intercept at the prior
            slope = max(self.prior[0], 0.0) if mx <= 0 else max((my - self.prior[1]) / mx, 0.0)
            return slope, max(my - slope * mx, 0.0)
        slope = (self._sxy / w - mx * my) / var
        if slope <= 0:  # the samples say nothing about the slope (noise, or a narrow range): a line through the origin
            return (self._sxy / self._sxx if self._sxx > 0 else max(self.prior[0], 0.0)), 0.0
        return slope, max(my - slope * mx, 0.0)


@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """One prefill in flight on a worker (from :meth:`PrefillQueue.start`): a Prefill call, or a local prefill."""

    worker: str
    started: float  # clock seconds
    seq: int  # its number among the worker's starts
    ahead: frozenset[int]  # the calls in flight on the worker when it was sent: served before it (FIFO)
    expected_s: float  # its predicted service time when it was sent


#: a queued call served in less than this fraction of its predicted time shared an engine step with a call ahead of
#: it (their answers reach us one by one, milliseconds apart): its time is not its own
BATCHED_FRACTION = 0.5


class _WorkerQueue:
    __slots__ = ("inflight", "busy_until", "starts", "last_end")

    def __init__(self) -> None:
        self.inflight: set[int] = set()  # the seqs of the calls in flight
        self.busy_until, self.starts, self.last_end = 0.0, 0, float("-inf")


class PrefillQueue:
    """What this router has sent each prefill worker and not yet seen answered.

    ``wait_s(worker)``: seconds until a prefill sent now would start there, each call in flight queued after the one
    before it at its predicted service time ``o + a * n`` (FIFO; the estimate resets to zero when the worker has
    nothing of ours in flight). ``end`` gives a call's service time: from the later of its start and the end of the
    last call ahead of it (a FIFO server's service time), or None when that is unknown (a call ahead of it is still
    running, or it was queued and took under ``BATCHED_FRACTION`` of its predicted time: it shared an engine step with
    a call ahead). A call with nothing ahead always gives its time, so the fit can learn that a worker is faster than
    predicted. A worker shared by several routers is busier than one router's view of it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._workers: dict[str, _WorkerQueue] = {}

    def start(self, worker: str, service_s: float) -> QueuedPrefill:
        """Record a call sent to ``worker`` expected to take ``service_s`` seconds of its time once started."""
        q = self._workers.setdefault(worker, _WorkerQueue())
        now = self.clock()
        q.starts += 1
        call = QueuedPrefill(worker, now, q.starts, frozenset(q.inflight), max(service_s, 0.0))
        q.inflight.add(q.starts)
        q.busy_until = max(q.busy_until, now) + max(service_s, 0.0)
        return call

    def end(self, call: QueuedPrefill) -> tuple[float, float | None]:
        """The call answered (or failed): (its seconds, its service seconds or None; see the class)."""
        q = self._workers[call.worker]
        now = self.clock()
        q.inflight.discard(call.seq)
        service = None
        if not call.ahead:
            service = now - call.started
        elif call.ahead.isdisjoint(q.inflight):
            served = now - max(call.started, q.last_end)
            service = served if served >= BATCHED_FRACTION * call.expected_s else None
        q.last_end = now
        if not q.inflight:
            q.busy_until = now
        return now - call.started, service

    def wait_s(self, worker: str) -> float:
        q = self._workers.get(worker)
        return 0.0 if q is None or not q.inflight else max(q.busy_until - self.clock(), 0.0)

    def describe(self) -> dict[str, float]:
        return {w: round(self.wait_s(w), 4) for w in self._workers}


@dataclass(frozen=True, slots=True)
class Decision:
    local: bool
    threshold: float
    uncached_tokens: int


class DisaggregationPolicy:
    """Decides local vs remote prefill per request and learns the costs from measurements.

    Args:
        mode: "always", "auto", or a non-negative integer threshold (as a string or int).
        beta: weight of the stall a local prefill causes to each running decode request (``auto``).
        max_threshold: cap of the ``auto`` threshold (tokens).
        max_local_stall_s: longest stall (seconds) a local prefill may cause the decode worker's running streams
            (``auto``; None: no cap).
    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str | int = "always", beta: float = 0.1, max_threshold: int = 1 << 20,
                 prior_prefill_s_per_token: float = 1e-3, clock: Callable[[], float] = time.monotonic,
                 max_local_stall_s: float | None = 0.2) -> None:
        mode = str(mode).strip().lower()
        if mode not in ("always", "auto") and not (mode.isdigit()):
            raise ValueError(f"--disagg must be 'always', 'auto' or a token count, got {mode!r}")
        self.mode = mode
        self.fixed = int(mode) if mode.isdigit() else None
        self.beta, self.max_threshold, self.max_local_stall_s = beta, max_threshold, max_local_stall_s
        a = prior_prefill_s_per_token
        self.remote_prefill = LinearFit(a, 0.0, anchor_weight=1.0)
        self.local_prefill = LinearFit(a, 0.0, anchor_weight=1.0)
        self.transfer = LinearFit(0.0, 0.0, anchor_weight=1.0)
        self.prefill_queue = PrefillQueue(clock)  # Prefill calls on prefill workers
        self.local_queue = PrefillQueue(clock)  # local prefills on decode workers, until their first token
        self.threshold = 0.0 if mode == "always" else float(self.fixed if self.fixed is not None else 0)
        DISAGG_THRESHOLD.set(self.threshold)

    def current_threshold(self, prefill_wait_s: float = 0.0, decode_running: float = 0.0, local_wait_s: float = 0.0) -> float:
        """Uncached prompt tokens below which local prefill is cheaper; ``prefill_wait_s`` the expected wait at the
        prefill worker (seconds), ``decode_running`` the decode worker's running requests, ``local_wait_s`` the
        expected wait behind the local prefills in flight on the decode worker (seconds)."""
        if self.mode == "always":
            return 0.0
        if self.fixed is not None:
            return float(self.fixed)
        a_p, o_p = self.remote_prefill.params()
        a_d, o_d = self.local_prefill.params()
        s_x, o_x = self.transfer.params()
        denom = a_d * (1 + self.beta * decode_running) - a_p - s_x
        num = prefill_wait_s + o_p + o_x - o_d - local_wait_s
        cap = float(self.max_threshold)
        if self.max_local_stall_s is not None:  # (a fit without a slope yet: the prior's)
            cap = min(cap, self.max_local_stall_s / (a_d if a_d > 0 else self.local_prefill.prior[0]))
        if denom <= 0:  # local costs no more per token: it wins everywhere unless it starts behind
            return cap if num >= 0 else 0.0
        return min(max(num / denom, 0.0), cap)

    def decide(self, uncached_tokens: int, prefill_wait_s: float = 0.0, decode_running: float = 0.0,
               local_wait_s: float = 0.0) -> Decision:
        """Local (on the decode worker) when ``uncached_tokens`` is below the current threshold (see
        :meth:`current_threshold`; the waits usually ``self.prefill_queue.wait_s(worker)`` and
        ``self.local_queue.wait_s(worker)``)."""
        t = self.current_threshold(prefill_wait_s, decode_running, local_wait_s)
        self.threshold = t
        DISAGG_THRESHOLD.set(t)
        return Decision(local=uncached_tokens < t, threshold=t, uncached_tokens=uncached_tokens)

    # --- measurements -------------------------------------------------------------------------------------
    def remote_started(self, worker: str, tokens: int) -> QueuedPrefill:
        """A Prefill call of ``tokens`` uncached tokens was sent to ``worker``: it joins the worker's queue."""
        return _enqueue(self.prefill_queue, self.remote_prefill, worker, tokens)

    def remote_finished(self, call: QueuedPrefill, tokens: int | None) -> None:
        """The call answered after prefilling ``tokens`` uncached tokens (None: it failed). Its service time (not the
        wait behind the calls ahead of it; :class:`PrefillQueue`) is a sample of the prefill cost."""
        _dequeue(self.prefill_queue, call, tokens, self.observe_remote_prefill)

    def observe_remote_prefill(self, tokens: int, seconds: float) -> None:
        self.remote_prefill.add(tokens, seconds)
        DISAGG_PREFILL_SECONDS_PER_TOKEN.labels("remote").set(self.remote_prefill.params()[0])

    def local_started(self, worker: str, tokens: int) -> QueuedPrefill:
        """A local prefill of about ``tokens`` uncached tokens was sent to the decode worker ``worker``."""
        return _enqueue(self.local_queue, self.local_prefill, worker, tokens)

    def local_finished(self, call: QueuedPrefill, tokens: int | None) -> None:
        """Its first token came back after prefilling ``tokens`` uncached tokens (None: it failed first); its service
        time is a sample of the local cost."""
        _dequeue(self.local_queue, call, tokens, self.observe_local_prefill)

    def observe_local_prefill(self, tokens: int, seconds: float) -> None:
        self.local_prefill.add(tokens, seconds)
        DISAGG_PREFILL_SECONDS_PER_TOKEN.labels("local").set(self.local_prefill.params()[0])

    def observe_transfer(self, tokens: int, seconds: float) -> None:
        self.transfer.add(tokens, seconds)
        s, o = self.transfer.params()
        DISAGG_TRANSFER_SECONDS_PER_TOKEN.set(s)
        DISAGG_TRANSFER_OVERHEAD.set(o)

    def describe(self) -> dict:
        return {
            "mode": self.mode, "threshold_tokens": self.threshold, "max_local_stall_s": self.max_local_stall_s,
            "remote_prefill": dict(zip(("s_per_token", "overhead_s"), self.remote_prefill.params())),
            "local_prefill": dict(zip(("s_per_token", "overhead_s"), self.local_prefill.params())),
            "transfer": dict(zip(("s_per_token", "overhead_s"), self.transfer.params())),
            "prefill_wait_s": self.prefill_queue.describe(), "local_prefill_wait_s": self.local_queue.describe(),
        }


def _enqueue(queue: PrefillQueue, fit: LinearFit, worker: str, tokens: int) -> QueuedPrefill:
    """A prefill of ``tokens`` tokens joins ``worker``'s queue at the service time ``fit`` predicts for it."""
    slope, intercept = fit.params()
    return queue.start(worker, intercept + slope * tokens)


def _dequeue(queue: PrefillQueue, call: QueuedPrefill, tokens: int | None,
             observe: Callable[[int, float], None]) -> None:
    """``call`` ended after prefilling ``tokens`` tokens (None: it failed): its service time, when known, to ``observe``."""
    _, service = queue.end(call)
    if tokens is not None and service is not None:
        observe(tokens, service)
