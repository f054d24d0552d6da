"""The master's state machine: segments, objects, two-phase puts, leases, eviction (no I/O, injected clock).

Every method runs to completion without awaiting, so the gRPC servicer may call it from its event loop
with no locking. Errors are the typed ``splitserve.errors.StoreError`` family (``InvalidRequest`` for
malformed arguments). Time comes only from ``clock`` (seconds, monotonic), so tests drive leases,
timeouts and eviction with a fake clock and never sleep.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from splitserve.errors import (
    InvalidRequest,
    NoStorageNode,
    ObjectAlreadyExists,
    ObjectHasLease,
    ObjectNotFound,
    ObjectNotReady,
    StoreNoSpace,
    WriteRevoked,
)
from splitserve.services.kvstore.master import eviction, leases
from splitserve.services.kvstore.master.allocator import SegmentAllocator
from splitserve.services.kvstore.master.config import MasterConfig
from splitserve.services.kvstore.master.metadata import ObjectMeta, ObjectState, Replica
from splitserve.services.kvstore.master.placement import placement_order
from splitserve.services.kvstore.master.segments import Segment

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Location:
    """A replica as clients see it: where to move the bytes."""

    node_id: str
    endpoint: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class PutTicket:
    put_id: int
    replicas: list[Location]


@dataclass(frozen=True, slots=True)
class ReadGrant:
    replicas: list[Location]
    size: int
    checksum: int
    lease_s: float


class KVStoreMaster:
    def __init__(self, config: MasterConfig = MasterConfig(), clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random()  # replica placement (master.placement); seed it in tests
        self.segments: dict[str, Segment] = {}
        self.objects: dict[str, ObjectMeta] = {}
        self._lru: OrderedDict[str, ObjectMeta] = OrderedDict()  # COMPLETE objects, least recently used first
        self._processing: dict[str, ObjectMeta] = {}  # PROCESSING objects, oldest PutStart first
        self._put_ids = itertools.count(1)
        self.counters: dict[str, int] = dict.fromkeys(
            ["puts_started", "puts_completed", "puts_revoked", "puts_reclaimed", "puts_rejected_exists",
             "puts_rejected_no_space", "gets", "get_hits", "leases_granted", "removes", "evicted_objects",
             "evicted_bytes", "nodes_mounted", "nodes_dropped", "replicas_dropped", "objects_lost", "placement_pauses"], 0)

    # ------------------------------------------------------------------ segments
    def mount_segment(self, node_id: str, endpoint: str, size: int) -> None:
        """Add (or replace: a restarted node's memory is new) the segment of ``node_id``."""
        if not node_id or not endpoint or size < 1:
            raise InvalidRequest("MountSegment needs a node_id, an endpoint and a size >= 1")
        if node_id in self.segments:
            self.unmount_segment(node_id)
        self.segments[node_id] = Segment(node_id, endpoint, SegmentAllocator(size, self.config.alignment), self.clock())
        self.counters["nodes_mounted"] += 1
        logger.info("segment of %s mounted: %d bytes at %s", node_id, size, endpoint)

    def unmount_segment(self, node_id: str) -> int:
        """Drop a segment and every replica on it; returns the number of replicas dropped."""
        seg = self.segments.pop(node_id, None)
        if seg is None:
            raise ObjectNotFound(f"no segment of node {node_id!r}")
        dropped = 0
        for key in list(seg.keys):
            obj = self.objects.get(key)
            if obj is None:
                continue
            obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
            dropped += 1
            if not obj.replicas:
                self.counters["objects_lost"] += 1
                self._forget(obj)
        self.counters["replicas_dropped"] += dropped
        return dropped

    def heartbeat(self, node_id: str) -> bool:
        """Record that ``node_id`` is alive; False if its segment is unknown (it must mount again)."""
        seg = self.segments.get(node_id)
        if seg is None:
            return False
        seg.last_heartbeat = self.clock()
        return True

    # ------------------------------------------------------------------ puts
    def put_start(self, key: str, size: int, replicas: int = 0) -> PutTicket:
        """Allocate ``replicas`` (0: the default) copies of ``size`` bytes on distinct nodes; the object is
        PROCESSING until :meth:`put_end`. Fewer copies than asked are placed when fewer nodes have room.

        Raises ObjectAlreadyExists (complete, or being written and not yet timed out), StoreNoSpace,
        NoStorageNode, InvalidRequest.
        """
        self._check_key(key)
        if not 1 <= size <= self.config.max_object_bytes:
            raise InvalidRequest(f"object size {size} out of range [1, {self.config.max_object_bytes}]")
        if not 0 <= replicas <= 16:
            raise InvalidRequest(f"replicas {replicas} out of range [0, 16]")
        now = self.clock()
        old = self.objects.get(key)
        if old is not None:
            if old.state is ObjectState.PROCESSING and now - old.started_at > self.config.put_timeout_s:
                self._reclaim(old)  # zombie write: preempted by the new writer
            else:
                self.counters["puts_rejected_exists"] += 1
                what = "exists" if old.state is ObjectState.COMPLETE else "is being written"
                raise ObjectAlreadyExists(f"object {key} {what}")
        if not self.segments:
            raise NoStorageNode("no storage node is mounted")
        want = replicas or self.config.default_replicas
        obj = ObjectMeta(key, size, next(self._put_ids), now)
        for seg in placement_order(list(self.segments.values()), now, self.config.heartbeat_interval_s, self.rng):
            if len(obj.replicas) == want:
                break
            offset = self._allocate(seg, size, now)
            if offset is not None:
                obj.replicas.append(Replica(seg.node_id, offset, size))
        if not obj.replicas:
            self.counters["puts_rejected_no_space"] += 1
            raise StoreNoSpace(f"no storage segment can hold {size} bytes for {key}, even after eviction")
        for r in obj.replicas:
            self.segments[r.node_id].keys.add(key)
        self.objects[key] = obj
        self._processing[key] = obj
        self.counters["puts_started"] += 1
        return PutTicket(obj.put_id, self._locations(obj))

    def put_end(self, key: str, put_id: int, checksum: int) -> None:
        """Publish a write: PROCESSING -> COMPLETE. Idempotent for the same put_id.

        Raises WriteRevoked (reclaimed, revoked or replaced; also when every replica was lost meanwhile).
        """
        obj = self._own_write(key, put_id)
        if obj.state is ObjectState.COMPLETE:
            return
        del self._processing[key]
        obj.state = ObjectState.COMPLETE
        obj.checksum = checksum
        obj.last_access = self.clock()
        self._lru[key] = obj
        self.counters["puts_completed"] += 1

    def put_revoke(self, key: str, put_id: int, failed_node_ids: Sequence[str] = ()) -> None:
        """Abandon a write: its space is freed. ``failed_node_ids``: storage nodes the writer could not write
        to; no new replicas go there for ``heartbeat_timeout_s`` (by then a dead node is dropped).
        Raises WriteRevoked if it is not an open write of put_id."""
        self.pause_placement(failed_node_ids)
        obj = self._own_write(key, put_id)
        if obj.state is not ObjectState.PROCESSING:
            raise WriteRevoked(f"write {put_id} of {key} is already complete")
        self.counters["puts_revoked"] += 1
        self._forget(obj)

    def pause_placement(self, node_ids: Sequence[str]) -> None:
        """No new replicas on ``node_ids`` (a client failed to write there) for ``heartbeat_timeout_s``."""
        until = self.clock() + self.config.heartbeat_timeout_s
        for node_id in node_ids:
            seg = self.segments.get(node_id)
            if seg is not None and seg.placement_paused_until < until:
                seg.placement_paused_until = until
                self.counters["placement_pauses"] += 1
                logger.warning("a write to storage node %s failed: no new replicas there for %.1fs", node_id,
                               self.config.heartbeat_timeout_s)

    def _own_write(self, key: str, put_id: int) -> ObjectMeta:
        obj = self.objects.get(key)
        if obj is None or obj.put_id != put_id:
            raise WriteRevoked(f"write {put_id} of {key} was reclaimed, revoked or replaced")
        return obj

    # ------------------------------------------------------------------ reads
    def get_replica_list(self, key: str) -> ReadGrant:
        """Replicas of a COMPLETE object, with a read lease. Raises ObjectNotFound / ObjectNotReady."""
        self._check_key(key)
        self.counters["gets"] += 1
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectNotFound(f"object {key} not found")
        if obj.state is not ObjectState.COMPLETE:
            raise ObjectNotReady(f"object {key} is being written")
        now = self.clock()
        lease_s = leases.grant(obj, now, self.config.lease_s)
        obj.last_access = now
        self._lru.move_to_end(key)
        self.counters["get_hits"] += 1
        self.counters["leases_granted"] += 1
        return ReadGrant(self._locations(obj), obj.size, obj.checksum, lease_s)

    def exist(self, key: str) -> bool:
        """True if the object is COMPLETE (grants no lease, does not touch the LRU order)."""
        self._check_key(key)
        obj = self.objects.get(key)
        return obj is not None and obj.state is ObjectState.COMPLETE

    def remove(self, key: str, ignore_lease: bool = False) -> None:
        """Remove a COMPLETE object. Raises ObjectNotFound, ObjectNotReady, ObjectHasLease."""
        self._check_key(key)
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectNotFound(f"object {key} not found")
        if obj.state is not ObjectState.COMPLETE:
            raise ObjectNotReady(f"object {key} is being written")
        if not ignore_lease and leases.is_leased(obj, self.clock()):
            raise ObjectHasLease(f"object {key} is under a read lease")
        self.counters["removes"] += 1
        self._forget(obj)

    # ------------------------------------------------------------------ background sweep
    def tick(self) -> tuple[list[str], list[str]]:
        """Drop nodes silent past the heartbeat timeout and reclaim zombie writes.
        Returns (dead node ids, reclaimed keys)."""
        now = self.clock()
        dead = [s.node_id for s in self.segments.values() if now - s.last_heartbeat > self.config.heartbeat_timeout_s]
        for node_id in dead:
            logger.warning("storage node %s missed heartbeats for %.1fs: dropping its replicas", node_id, self.config.heartbeat_timeout_s)
            self.unmount_segment(node_id)
            self.counters["nodes_dropped"] += 1
        reclaimed = []
        for obj in list(self._processing.values()):
            if now - obj.started_at <= self.config.put_timeout_s:
                break  # oldest first
            reclaimed.append(obj.key)
            self._reclaim(obj)
        return dead, reclaimed

    # ------------------------------------------------------------------ internals
    def _allocate(self, seg: Segment, size: int, now: float) -> int | None:
        cfg = self.config
        need = eviction.bytes_to_free(seg.used, seg.allocator.aligned(size), seg.capacity, cfg.evict_high, cfg.evict_low)
        for victim in eviction.pick_victims(self._lru, seg.node_id, need, now, seg.allocator.aligned):
            self._evict(victim)
        offset = seg.allocator.allocate(size)
        while offset is None:  # fragmented (or everything leased): evict one more, least recently used first
            victim = next(eviction.evictable(self._lru, seg.node_id, now), None)
            if victim is None:
                return None
            self._evict(victim)
            offset = seg.allocator.allocate(size)
        return offset

    def _evict(self, obj: ObjectMeta) -> None:
        self.counters["evicted_objects"] += 1
        self.counters["evicted_bytes"] += obj.size
        self._forget(obj)

    def _reclaim(self, obj: ObjectMeta) -> None:
        logger.warning("reclaiming zombie write %d of %s (no PutEnd within %.1fs)", obj.put_id, obj.key, self.config.put_timeout_s)
        self.counters["puts_reclaimed"] += 1
        self._forget(obj)

    def _forget(self, obj: ObjectMeta) -> None:
        """Free every replica and drop the object from all tables (state REMOVED)."""
        for r in obj.replicas:
            seg = self.segments.get(r.node_id)
            if seg is not None:
                seg.allocator.free(r.offset)
                seg.keys.discard(obj.key)
        obj.replicas = []
        obj.state = ObjectState.REMOVED
        self.objects.pop(obj.key, None)
        self._lru.pop(obj.key, None)
        self._processing.pop(obj.key, None)

    def _locations(self, obj: ObjectMeta) -> list[Location]:
        return [Location(r.node_id, self.segments[r.node_id].endpoint, r.offset, r.size) for r in obj.replicas]

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str) or not key or len(key.encode()) > self.config.max_key_bytes:
            raise InvalidRequest(f"object keys must be 1..{self.config.max_key_bytes} bytes of UTF-8")

    def stats(self) -> dict[str, float]:
        segs = list(self.segments.values())
        return {
            **self.counters,
            "segments": len(segs),
            "capacity_bytes": sum(s.capacity for s in segs),
            "used_bytes": sum(s.used for s in segs),
            "objects": len(self.objects),
            "objects_complete": len(self._lru),
            "objects_processing": len(self._processing),
        }
