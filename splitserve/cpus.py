"""CPU lists (``"0,2-3"``) and pinning a whole process to them (``--cpus`` of every engine-bearing command).

Two workers on one machine each run a torch thread pool; unpinned, the kernel moves their threads across
the same cores and they slow each other down. ``--cpus`` gives each process its own cores. Torch-free.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def parse_cpus(text: str) -> set[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}``. Raises ValueError on a malformed list."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"bad CPU list {text!r} (expected e.g. 0 or 0,2-3)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def check_cpus(text: str) -> set[int]:
    """The CPUs of ``text``, which must all be ones this process may run on (``os.sched_getaffinity``).

    Raises:
        ValueError: a malformed list, or CPUs outside the allowed set (the message names both).
    """
    cpus = parse_cpus(text)
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"--cpus {text}: CPUs {sorted(cpus - allowed)} are not available "
                         f"(this process may run on {format_cpus(allowed)})")
    return cpus


def format_cpus(cpus: set[int]) -> str:
    """``{0, 2, 3}`` -> ``"0,2-3"``."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def pin_process(text: str) -> set[int] | None:
    """Pin every thread of this process (and the threads it starts later, which inherit the mask) to the
    CPUs of ``text``; "" leaves the affinity alone. Call it before torch starts its thread pool. Returns the
    CPUs, or None when not pinned.

    Raises:
        ValueError: as :func:`check_cpus`.
    """
    if not text:
        return None
    cpus = check_cpus(text)
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity(0) would pin only the calling thread
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    logger.info("pinned to CPUs %s", format_cpus(cpus))
    return cpus
