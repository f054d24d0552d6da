"""Objects and replicas as the master tracks them (plain data, no I/O).

State machine of one object (``ObjectState``)::

    PutStart ──► PROCESSING ──PutEnd──► COMPLETE ──Remove / eviction──► REMOVED
                     │                     │
                     ├─PutRevoke──────────►├─ last replica's node dies ─► REMOVED
                     ├─put timeout (zombie write reclaimed)─► REMOVED
                     └─ last replica's node dies ─► REMOVED

Only COMPLETE objects are readable; only COMPLETE objects without a live read lease can be removed or
evicted. A REMOVED object is gone from the master's tables (the state is kept on the dataclass so a
caller still holding it can tell).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ObjectState(enum.Enum):
    PROCESSING = "processing"
    COMPLETE = "complete"
    REMOVED = "removed"


@dataclass(slots=True)
class Replica:
    """One copy: ``size`` bytes at ``offset`` in the segment of storage node ``node_id``."""

    node_id: str
    offset: int
    size: int


@dataclass(slots=True)
class ObjectMeta:
    """One object (a KV block under its block hash, or any key).

    Attributes:
        size: bytes of the object (every replica holds exactly this many).
        put_id: names the write that created it; PutEnd/PutRevoke must present it.
        started_at: clock time of PutStart (for the zombie-write timeout).
        last_access: clock time of PutEnd or the latest read (LRU order).
        lease_until: no Remove or eviction before this clock time (read leases).
        checksum: xxh3_64 of the bytes as given at PutEnd (0 while PROCESSING).
    """

    key: str
    size: int
    put_id: int
    started_at: float
    replicas: list[Replica] = field(default_factory=list)
    state: ObjectState = ObjectState.PROCESSING
    last_access: float = 0.0
    lease_until: float = 0.0
    checksum: int = 0

    def replica_on(self, node_id: str) -> Replica | None:
        for r in self.replicas:
            if r.node_id == node_id:
                return r
        return None
