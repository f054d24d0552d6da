"""Checks shared by the frozen config dataclasses (raise ValueError, as their ``__post_init__`` do)."""

from __future__ import annotations


def check_port(name: str, port: int) -> None:
    """``port`` is a TCP port number, or 0 for any free port.

    Raises:
        ValueError: outside [0, 65535] (the OS would otherwise wrap 70000 to 4464 or refuse -1 late).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port in [0, 65535] (0: any free port), got {port!r}")
