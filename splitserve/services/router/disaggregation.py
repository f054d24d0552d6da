"""Conditional disaggregation: prefill on a prefill worker (KV handoff) or locally on the decode worker.

Modes (``--disagg``):

* ``always``: every request is prefilled remotely (the classic PD split; the default).
* ``N`` (an integer): fixed threshold -- a request with fewer than N *uncached* prompt tokens is
  prefilled locally on the decode worker; longer ones go to a prefill worker.
* ``auto``: the threshold is the crossover of two measured linear cost models, refreshed per request::

      local(n)  = o_d + a_d * n * (1 + beta * R_d)
      remote(n) = W_p + o_p + a_p * n + o_x + s_x * n
      threshold = (W_p + o_p + o_x - o_d) / (a_d * (1 + beta * R_d) - a_p - s_x)

  ``n`` uncached prompt tokens. ``a_p, o_p``: prefill seconds/token and fixed overhead on a prefill worker, fitted
  to the Prefill RPCs that ran *alone* on their worker (nothing else of this router's in flight there from start to
  end), so the fit is a service time, not a queue. ``W_p``: the expected wait at the chosen prefill worker -- every
  Prefill call this router sent there and has not seen answered, each queued after the one before at its predicted
  service time (:class:`PrefillQueue`; FIFO, as a prefill worker admits them). ``a_d, o_d``: the same for local
  prefill on the decode worker (time from the Decode call to the first streamed token: the wait for the running
  step included, which a remote prefill does not pay). ``s_x, o_x``: the KV handoff, fitted to the pull times the
  decode worker reports (``DecodeResponse.kv_transfer_us``). ``R_d``: requests running on the decode worker, each
  stalled for the length of a local prefill (``beta`` weighs that interference against the request's own TTFT).
  A non-positive denominator means local prefill is never slower: the threshold is ``max_threshold``.
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
    """Online least squares ``y = intercept + slope * x`` with exponential forgetting (``decay`` per sample)."""

    def __init__(self, slope: float, intercept: float, decay: float = 0.97, min_samples: int = 3) -> None:
        self.prior = (slope, intercept)
        self.decay, self.min_samples = decay, min_samples
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
        mx, my = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mx * mx
        if var <= 1e-9 * max(mx * mx, 1.0):  # all x equal: no slope information, keep the intercept at the prior
            slope = max(self.prior[0], 0.0) if mx <= 0 else max((my - self.prior[1]) / mx, 0.0)
            return slope, max(my - slope * mx, 0.0)
        slope = (self._sxy / self._w - mx * my) / var
        slope = max(slope, 0.0)
        return slope, max(my - slope * mx, 0.0)


@dataclass(frozen=True, slots=True)
class RemoteCall:
    """One Prefill call in flight (from :meth:`PrefillQueue.start`)."""

    worker: str
    started: float  # clock seconds
    alone: bool  # nothing else of this router's was in flight on the worker when it started
    seq: int  # the worker's start count at this start: another start since means the call did not run alone


class _WorkerQueue:
    __slots__ = ("inflight", "busy_until", "starts")

    def __init__(self) -> None:
        self.inflight, self.busy_until, self.starts = 0, 0.0, 0


class PrefillQueue:
    """What this router has sent each prefill worker and not yet seen answered.

    ``wait_s(worker)``: seconds until a prefill sent now would start there, each call in flight queued after the one
    before it at its predicted service time ``o_p + a_p * n`` (FIFO; the estimate resets to zero when the worker has
    nothing of ours in flight). A worker shared by several routers is busier than one router's view of it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._workers: dict[str, _WorkerQueue] = {}

    def start(self, worker: str, service_s: float) -> RemoteCall:
        """Record a call sent to ``worker`` expected to take ``service_s`` seconds of its time once started."""
        q = self._workers.setdefault(worker, _WorkerQueue())
        now = self.clock()
        alone = q.inflight == 0
        q.inflight += 1
        q.starts += 1
        q.busy_until = max(q.busy_until, now) + max(service_s, 0.0)
        return RemoteCall(worker, now, alone, q.starts)

    def end(self, call: RemoteCall) -> tuple[float, bool]:
        """The call answered (or failed): (its seconds, whether it ran alone on the worker from start to end)."""
        q = self._workers[call.worker]
        now = self.clock()
        q.inflight -= 1
        if q.inflight <= 0:
            q.inflight, q.busy_until = 0, now
        return now - call.started, call.alone and q.starts == call.seq

    def wait_s(self, worker: str) -> float:
        q = self._workers.get(worker)
        return 0.0 if q is None or q.inflight == 0 else max(q.busy_until - self.clock(), 0.0)

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
        self.remote_prefill = LinearFit(a, 0.0)
        self.local_prefill = LinearFit(a, 0.0)
        self.transfer = LinearFit(0.0, 0.0)
        self.prefill_queue = PrefillQueue(clock)
        self.threshold = 0.0 if mode == "always" else float(self.fixed if self.fixed is not None else 0)
        DISAGG_THRESHOLD.set(self.threshold)

    def current_threshold(self, prefill_wait_s: float = 0.0, decode_running: float = 0.0) -> float:
        """Uncached prompt tokens below which local prefill is cheaper; ``prefill_wait_s`` the expected wait at the
        prefill worker (seconds), ``decode_running`` the decode worker's running requests."""
        if self.mode == "always":
            return 0.0
        if self.fixed is not None:
            return float(self.fixed)
        a_p, o_p = self.remote_prefill.params()
        a_d, o_d = self.local_prefill.params()
        s_x, o_x = self.transfer.params()
        denom = a_d * (1 + self.beta * decode_running) - a_p - s_x
        num = prefill_wait_s + o_p + o_x - o_d
        cap = float(self.max_threshold)
        if self.max_local_stall_s is not None and a_d > 0:
            cap = min(cap, self.max_local_stall_s / a_d)
        return cap if denom <= 0 else min(max(num / denom, 0.0), cap)

    def decide(self, uncached_tokens: int, prefill_wait_s: float = 0.0, decode_running: float = 0.0) -> Decision:
        """Local (on the decode worker) when ``uncached_tokens`` is below the current threshold (see
        :meth:`current_threshold`; ``prefill_wait_s`` usually ``self.prefill_queue.wait_s(worker)``)."""
        t = self.current_threshold(prefill_wait_s, decode_running)
        self.threshold = t
        DISAGG_THRESHOLD.set(t)
        return Decision(local=uncached_tokens < t, threshold=t, uncached_tokens=uncached_tokens)

    # --- measurements -------------------------------------------------------------------------------------
    def remote_started(self, worker: str, tokens: int) -> RemoteCall:
        """A Prefill call of ``tokens`` uncached tokens was sent to ``worker``: it joins the worker's queue."""
        a_p, o_p = self.remote_prefill.params()
        return self.prefill_queue.start(worker, o_p + a_p * tokens)

    def remote_finished(self, call: RemoteCall, tokens: int | None) -> None:
        """The call answered after prefilling ``tokens`` uncached tokens (None: it failed). Its time is a sample of
        the prefill cost only if it ran alone on the worker (otherwise it includes the wait behind other calls)."""
        seconds, alone = self.prefill_queue.end(call)
        if tokens is not None and alone:
            self.observe_remote_prefill(tokens, seconds)

    def observe_remote_prefill(self, tokens: int, seconds: float) -> None:
        self.remote_prefill.add(tokens, seconds)
        DISAGG_PREFILL_SECONDS_PER_TOKEN.labels("remote").set(self.remote_prefill.params()[0])

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
            "prefill_wait_s": self.prefill_queue.describe(),
        }
