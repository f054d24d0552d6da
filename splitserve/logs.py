"""Logging set-up shared by every process: one line per record, service name first."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str) -> None:
    level = os.environ.get("PD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service:8s} %(levelname)-7s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "httpcore"):  # one line per health poll otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
