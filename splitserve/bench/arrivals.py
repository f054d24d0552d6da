"""Request arrival times (seconds from the start of a run), seeded and reproducible.

Fixed concurrency is not an arrival process (the next request starts when one finishes); the
client implements it.
"""

from __future__ import annotations

import numpy as np


def poisson(rate: float, n: int, seed: int) -> list[float]:
    """``n`` arrival times of a Poisson process of ``rate`` requests/s (exponential gaps); the first is at 0.

    Raises:
        ValueError: rate <= 0 or n < 0.
    """
    return gamma(rate, n, seed, burstiness=1.0)


def gamma(rate: float, n: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """Arrivals with gamma-distributed gaps of mean ``1/rate``.

    ``burstiness`` is the gamma shape: 1 is Poisson, < 1 burstier (clumps and lulls), > 1 more
    regular (as vLLM's ``--burstiness``). The coefficient of variation of the gaps is
    ``1/sqrt(burstiness)``.

    Raises:
        ValueError: rate <= 0, burstiness <= 0 or n < 0.
    """
    if rate <= 0 or burstiness <= 0 or n < 0:
        raise ValueError(f"need rate > 0, burstiness > 0, n >= 0; got rate={rate}, burstiness={burstiness}, n={n}")
    if n == 0:
        return []
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def from_timestamps(timestamps_s: list[float], time_scale: float = 1.0) -> list[float]:
    """Trace times shifted to start at 0 and multiplied by ``time_scale`` (> 1 stretches, < 1 compresses).

    Raises:
        ValueError: time_scale <= 0.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if not timestamps_s:
        return []
    t0 = min(timestamps_s)
    return [(t - t0) * time_scale for t in timestamps_s]
