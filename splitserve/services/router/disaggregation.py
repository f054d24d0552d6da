"""Conditional disaggregation: prefill on a prefill worker (KV handoff) or locally on the decode worker.

Modes (``--disagg``):

* ``always``: every request is prefilled remotely (the classic PD split; the default).
* ``N`` (an integer): fixed threshold -- a request with fewer than N *uncached* prompt tokens is
  prefilled locally on the decode worker; longer ones go to a prefill worker.
* ``auto``: the threshold is the crossover of two measured linear cost models, refreshed per request::

      local(n)  = o_d + a_d * n * (1 + beta * R_d)
      remote(n) = q_p * a_p + o_p + a_p * n + o_x + s_x * n
      threshold = (q_p * a_p + o_p + o_x - o_d) / (a_d * (1 + beta * R_d) - a_p - s_x)

  ``n`` uncached prompt tokens; ``a_p, o_p`` prefill seconds/token and fixed overhead on prefill
  workers (regression of Prefill RPC time on uncached tokens); ``a_d, o_d`` the same for local
  prefill on decode workers (time to the first streamed token); ``s_x, o_x`` KV handoff seconds/token
  and per-transfer overhead (time from the Decode call to its first message after a remote prefill);
  ``q_p`` queued prefill tokens on the least loaded prefill worker; ``R_d`` requests running on the
  decode worker, each stalled by a local prefill (``beta`` weighs that interference). A non-positive
  denominator means local prefill is never slower: the threshold is ``max_threshold``.

Until a model has ``min_samples`` samples its prior is used (remote and local speed equal, no transfer
cost), so ``auto`` starts by prefilling short prompts locally and learns from there.
"""

from __future__ import annotations

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
    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str | int = "always", beta: float = 0.1, max_threshold: int = 1 << 20,
                 prior_prefill_s_per_token: float = 1e-3) -> None:
        mode = str(mode).strip().lower()
        if mode not in ("always", "auto") and not (mode.isdigit()):
            raise ValueError(f"--disagg must be 'always', 'auto' or a token count, got {mode!r}")
        self.mode = mode
        self.fixed = int(mode) if mode.isdigit() else None
        self.beta, self.max_threshold = beta, max_threshold
        a = prior_prefill_s_per_token
        self.remote_prefill = LinearFit(a, 0.0)
        self.local_prefill = LinearFit(a, 0.0)
        self.transfer = LinearFit(0.0, 0.0)
        self.threshold = 0.0 if mode == "always" else float(self.fixed if self.fixed is not None else 0)
        DISAGG_THRESHOLD.set(self.threshold)

    def current_threshold(self, queued_prefill_tokens: float = 0.0, decode_running: float = 0.0) -> float:
        if self.mode == "always":
            return 0.0
        if self.fixed is not None:
            return float(self.fixed)
        a_p, o_p = self.remote_prefill.params()
        a_d, o_d = self.local_prefill.params()
        s_x, o_x = self.transfer.params()
        denom = a_d * (1 + self.beta * decode_running) - a_p - s_x
        num = queued_prefill_tokens * a_p + o_p + o_x - o_d
        if denom <= 0:
            t = float(self.max_threshold)
        else:
            t = min(max(num / denom, 0.0), float(self.max_threshold))
        return t

    def decide(self, uncached_tokens: int, queued_prefill_tokens: float = 0.0, decode_running: float = 0.0) -> Decision:
        """Local (on the decode worker) when ``uncached_tokens`` is below the current threshold."""
        t = self.current_threshold(queued_prefill_tokens, decode_running)
        self.threshold = t
        DISAGG_THRESHOLD.set(t)
        return Decision(local=uncached_tokens < t, threshold=t, uncached_tokens=uncached_tokens)

    # --- measurements -------------------------------------------------------------------------------------
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
            "mode": self.mode, "threshold_tokens": self.threshold,
            "remote_prefill": dict(zip(("s_per_token", "overhead_s"), self.remote_prefill.params())),
            "local_prefill": dict(zip(("s_per_token", "overhead_s"), self.local_prefill.params())),
            "transfer": dict(zip(("s_per_token", "overhead_s"), self.transfer.params())),
        }
