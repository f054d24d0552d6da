"""Storage segments known to the master: one per storage node, with its allocator and liveness."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.services.kvstore.master.allocator import SegmentAllocator


@dataclass(slots=True)
class Segment:
    """The memory segment of storage node ``node_id``, reachable for data at ``endpoint`` (UCX)."""

    node_id: str
    endpoint: str
    allocator: SegmentAllocator
    last_heartbeat: float
    keys: set[str] = field(default_factory=set)  # objects with a replica here
    placement_paused_until: float = 0.0  # a client reported a failed write here: no new replicas until then

    @property
    def free(self) -> int:
        return self.allocator.capacity - self.allocator.used_bytes

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used_bytes
