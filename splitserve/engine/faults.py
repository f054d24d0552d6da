"""Fault injection for tests of slow and hung workers. Off unless ``PD_FAULT_STEP_DELAY_MS`` is set; never set it
in production.

``PD_FAULT_STEP_DELAY_MS=N``: every engine step (forward pass) of the worker takes N ms longer, so that chaos
tests on real processes can act while streams are surely in flight, whatever the speed of the machine.
"""

from __future__ import annotations

import logging
import time

from splitserve.env import env_float

logger = logging.getLogger(__name__)


def apply_engine_faults(engine, env: dict[str, str] | None = None) -> None:
    """Slow ``engine`` (an :class:`~splitserve.engine.async_engine.AsyncEngine`) down as ``PD_FAULT_STEP_DELAY_MS``
    says. Raises ValueError for a value that is not a number >= 0."""
    delay_ms = env_float("PD_FAULT_STEP_DELAY_MS", None, env)
    if delay_ms is None:
        return
    delay_s = delay_ms / 1000
    if not delay_s >= 0:
        raise ValueError(f"PD_FAULT_STEP_DELAY_MS must be >= 0, got {delay_ms!r}")
    logger.warning("engine fault injection is ON: +%g ms per step (tests only)", delay_s * 1000)
    runner = engine.core.runner
    execute = runner.execute

    def slow_execute(*args, **kwargs):  # runs on the engine thread
        time.sleep(delay_s)
        return execute(*args, **kwargs)

    runner.execute = slow_execute
