"""A periodic one-line engine stats log at INFO, as vLLM's ``LoggingStatLogger`` prints.

Every ``interval_s`` seconds while there is activity (tokens computed, requests running or waiting)::

    prefill worker: running 3 reqs, waiting 0 reqs, KV cache 41.2% (422/1024 blocks), prompt 812.4 tokens/s, generation 96.0 tokens/s

An idle engine logs one line when it becomes idle, then nothing until work comes back. Throughputs are
deltas of the engine's ``prefill_tokens`` / ``decode_tokens`` counters over the wall time between two
reads (tokens/s). ``PD_STATS_LOG_INTERVAL_S`` (``--stats-log-interval-s``; default 10, 0: off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Awaitable, Callable

from splitserve.env import env_float

logger = logging.getLogger("splitserve.stats")


def stats_line(name: str, now: dict[str, float], before: dict[str, float] | None, elapsed_s: float) -> str:
    """The log line for engine counters ``now`` (``AsyncEngine.stats()`` keys) against ``before``, read
    ``elapsed_s`` seconds earlier (None: the first read; throughputs are then 0)."""
    total = now.get("kv_blocks_total", 0) or 1
    used = total - now.get("kv_blocks_free", 0)

    def rate(key: str) -> float:
        if before is None or elapsed_s <= 0:
            return 0.0
        return max(0.0, now.get(key, 0) - before.get(key, 0)) / elapsed_s

    return (f"{name}: running {int(now.get('requests_running', 0))} reqs, waiting {int(now.get('requests_waiting', 0))} reqs, "
            f"KV cache {100.0 * used / total:.1f}% ({int(used)}/{int(total)} blocks), "
            f"prompt {rate('prefill_tokens'):.1f} tokens/s, generation {rate('decode_tokens'):.1f} tokens/s")


def _active(now: dict[str, float], before: dict[str, float] | None) -> bool:
    moved = before is not None and any(now.get(k, 0) != before.get(k, 0) for k in ("prefill_tokens", "decode_tokens"))
    return moved or now.get("requests_running", 0) > 0 or now.get("requests_waiting", 0) > 0


class StatsLogger:
    """Logs :func:`stats_line` of ``read()`` every ``interval_s`` (> 0) while active; ``run()`` until cancelled."""

    def __init__(self, name: str, read: Callable[[], Awaitable[dict[str, float]]], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.name, self.read, self.interval_s, self.clock = name, read, interval_s, clock
        self._before: dict[str, float] | None = None
        self._at = 0.0
        self._was_active = False

    async def tick(self) -> str | None:
        """Read the counters once; returns the line logged (None when idle and already said so)."""
        now, at = await self.read(), self.clock()
        first, active = self._before is None, _active(now, self._before)
        line = stats_line(self.name, now, self._before, at - self._at) if (first or active or self._was_active) else None
        self._before, self._at, self._was_active = now, at, active
        if line is not None:
            logger.info("%s", line)
        return line

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a stats read must never take the worker down
                logger.debug("stats read failed", exc_info=True)
            await asyncio.sleep(self.interval_s)


def start_stats_log(name: str, read: Callable[[], Awaitable[dict[str, float]]], interval_s: float) -> asyncio.Task | None:
    """A task running :class:`StatsLogger` (None when ``interval_s`` is 0: off). Cancel it to stop."""
    if interval_s <= 0:
        return None
    return asyncio.get_running_loop().create_task(StatsLogger(name, read, interval_s).run(), name=f"{name}-stats-log")


def add_stats_log_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--stats-log-interval-s", type=float, default=env_float("PD_STATS_LOG_INTERVAL_S", 10.0),
                    help="seconds between one-line engine stats logs at INFO (running/waiting requests, KV cache use, "
                         "prompt and generation tokens/s); 0: off")
