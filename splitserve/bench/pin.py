"""``python -m splitserve.bench.pin CPUS [NICE] -- PROGRAM ARGS...``: run PROGRAM pinned to CPUS (``0``, ``0,1``).

Sets the CPU affinity (and, if given, the nice value) of this process and then ``exec``s the
program, so the program and every thread it starts stay on those cores (same pid; the
parent-death signal set by the launcher survives the exec). Like ``taskset -c CPUS nice -n NICE``
without needing util-linux. A negative nice value needs root; it only raises the priority of the
benchmark's own processes against other load on a shared machine. With the kernel's autogroup
scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) a process nice value only matters inside
its session, so the nice value is also written to ``/proc/self/autogroup`` (this session's group).
"""

from __future__ import annotations

import os
import sys

from splitserve.cpus import parse_cpus


def pinned(cpus: str, argv: list[str], nice: int | None = None) -> list[str]:
    """argv that runs ``argv`` pinned to ``cpus`` (at ``nice`` if given)."""
    parse_cpus(cpus)
    return [sys.executable, "-m", "splitserve.bench.pin", cpus, *([str(nice)] if nice is not None else []), "--", *argv]


def set_nice(nice: int) -> None:
    """Set this process's nice value and, where autogroup scheduling is on, its session group's."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup support, or not permitted: the process nice value still applies
        pass


def main() -> None:
    args = sys.argv[1:]
    sep = args.index("--") if "--" in args else -1
    if sep not in (1, 2) or len(args) <= sep + 1:
        sys.exit("usage: python -m splitserve.bench.pin CPUS [NICE] -- PROGRAM [ARGS...]")
    os.sched_setaffinity(0, parse_cpus(args[0]))
    if sep == 2:
        set_nice(int(args[1]))
    os.execvp(args[sep + 1], args[sep + 1:])


if __name__ == "__main__":
    main()
