"""The periodic one-line engine stats log (vLLM-style): content, rates, quiet when idle."""

from __future__ import annotations

import logging

import pytest

from splitserve.telemetry.stats_log import StatsLogger, start_stats_log, stats_line


def stats(prefill=0, decode=0, running=0, waiting=0, free=100, total=100):
    return {"prefill_tokens": prefill, "decode_tokens": decode, "requests_running": running, "requests_waiting": waiting,
            "kv_blocks_free": free, "kv_blocks_total": total}


def test_the_line_has_queues_kv_use_and_token_rates():
    line = stats_line("decode worker", stats(1000, 500, running=3, waiting=1, free=75), stats(200, 100), 4.0)
    assert line == ("decode worker: running 3 reqs, waiting 1 reqs, KV cache 25.0% (25/100 blocks), "
                    "prompt 200.0 tokens/s, generation 100.0 tokens/s")
    assert stats_line("x", stats(10, 10), None, 0.0).endswith("prompt 0.0 tokens/s, generation 0.0 tokens/s")


async def test_active_intervals_are_logged_and_an_idle_engine_says_so_once(caplog):
    reads = iter([stats(), stats(100, 0, running=1), stats(100, 40, running=1), stats(100, 40), stats(100, 40), stats(100, 40)])
    t = iter(range(0, 100, 10))

    async def read():
        return next(reads)

    logger = StatsLogger("prefill worker", read, 10.0, clock=lambda: float(next(t)))
    with caplog.at_level(logging.INFO, logger="splitserve.stats"):
        lines = [await logger.tick() for _ in range(6)]
    assert lines[0] is not None  # the first read: said once
    assert "running 1 reqs" in lines[1] and "prompt 10.0 tokens/s" in lines[1]
    assert "generation 4.0 tokens/s" in lines[2]
    assert lines[3] is not None and "running 0 reqs" in lines[3]  # became idle: one line
    assert lines[4] is None and lines[5] is None  # then quiet
    assert [r.getMessage() for r in caplog.records] == [line for line in lines if line]


def test_interval_zero_is_off_and_negative_is_refused():
    assert start_stats_log("x", None, 0) is None
    with pytest.raises(ValueError, match="interval_s"):
        StatsLogger("x", None, -1)
