"""How much CPU other processes took during a run (this machine may be shared): /proc accounting."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / _TICK


def _proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / _TICK  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass
class CpuWindow:
    """Start with ``CpuWindow.start(pids)``; ``stop()`` returns CPU use over the window."""

    pids: list[int]
    t0: float = 0.0
    busy0: float = 0.0
    ours0: float = 0.0

    @classmethod
    def start(cls, pids: list[int]) -> "CpuWindow":
        w = cls(list(pids))
        w.t0, w.busy0, w.ours0 = time.monotonic(), _busy_s(), w._ours()
        return w

    def _ours(self) -> float:
        return sum(_proc_cpu_s(p) for p in self.pids)

    def stop(self) -> dict:
        """``{elapsed_s, cores, busy_cores, ours_cores, foreign_cores}``: average cores busy in total,
        by the benchmark's own processes, and by everything else."""
        elapsed = max(1e-9, time.monotonic() - self.t0)
        busy = (_busy_s() - self.busy0) / elapsed
        ours = (self._ours() - self.ours0) / elapsed
        return {"elapsed_s": round(elapsed, 2), "cores": os.cpu_count(), "busy_cores": round(busy, 2),
                "ours_cores": round(ours, 2), "foreign_cores": round(max(0.0, busy - ours), 2),
                "loadavg_1m": round(os.getloadavg()[0], 2)}
