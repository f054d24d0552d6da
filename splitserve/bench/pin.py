"""``python -m splitserve.bench.pin CPUS -- PROGRAM ARGS...``: run PROGRAM pinned to CPUS (e.g. ``0`` or ``0,1``).

Sets the CPU affinity of this process and then ``exec``s the program, so the program and every
thread it starts stay on those cores (same pid; the parent-death signal set by the launcher
survives the exec). Equivalent to ``taskset -c CPUS``, without needing util-linux.
"""

from __future__ import annotations

import os
import sys


def parse_cpus(text: str) -> set[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}``. Raises ValueError on a malformed list."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pinned(cpus: str, argv: list[str]) -> list[str]:
    """argv that runs ``argv`` pinned to ``cpus``."""
    parse_cpus(cpus)
    return [sys.executable, "-m", "splitserve.bench.pin", cpus, "--", *argv]


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m splitserve.bench.pin CPUS -- PROGRAM [ARGS...]")
    os.sched_setaffinity(0, parse_cpus(args[0]))
    os.execvp(args[2], args[2:])


if __name__ == "__main__":
    main()
