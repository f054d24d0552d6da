"""Where the master places a new object's replicas: spread by free space, never on a node in doubt.

Placing every write on the least-used node sends 100% of writes to a restarted, empty node (a herd that
lasts until it fills up) and keeps choosing a node that just died until its heartbeat times out. Instead:

* nodes in doubt are skipped: one whose last heartbeat is older than ``2 x heartbeat_interval_s`` (it missed
  one), and one a client reported a failed write on (paused for ``heartbeat_timeout_s``: by then it is
  either dropped as dead or back); if every node is in doubt, all are used (writes are a cache, better tried);
* the others are ordered by a weighted random draw without replacement, weight = free bytes (+1), so an
  empty node gets more writes than a full one but not all of them (Efraimidis and Spirakis, "Weighted random
  sampling with a reservoir", Information Processing Letters 97(5), 2006: key = u ** (1 / w), largest first).
"""

from __future__ import annotations

import random

from splitserve.services.kvstore.master.segments import Segment


def placeable(seg: Segment, now: float, heartbeat_interval_s: float) -> bool:
    """``seg`` is neither silent past one heartbeat nor paused after a failed write."""
    return now - seg.last_heartbeat <= 2 * heartbeat_interval_s and now >= seg.placement_paused_until


def placement_order(segments: list[Segment], now: float, heartbeat_interval_s: float, rng: random.Random) -> list[Segment]:
    """``segments`` to try for a new object's replicas, in order (distinct nodes; see the module docstring)."""
    healthy = [s for s in segments if placeable(s, now, heartbeat_interval_s)] or list(segments)
    keyed = [(rng.random() ** (1.0 / (s.free + 1)), s.node_id, s) for s in healthy]
    keyed.sort(key=lambda k: (k[0], k[1]), reverse=True)
    return [s for _, _, s in keyed]
