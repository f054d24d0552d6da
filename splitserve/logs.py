"""Logging set-up shared by every process: one line per record, service name first."""

from __future__ import annotations

import logging

from splitserve.env import EnvError, env_str

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup_logging(service: str) -> None:
    level = env_str("PD_LOG_LEVEL", "INFO").upper()
    if level not in LEVELS:
        raise EnvError("PD_LOG_LEVEL", level, "one of " + ", ".join(LEVELS) + " (any case)")
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service:8s} %(levelname)-7s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "httpcore"):  # one line per health poll otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
