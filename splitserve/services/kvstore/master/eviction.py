"""Approximately-LRU eviction inside one segment (pure: picks victims, frees nothing).

Eviction starts when a put would take a segment above its high watermark and frees objects, least
recently used first, until the segment is at or below its low watermark. Objects that are being written
(PROCESSING) or under a read lease are skipped. A victim is evicted whole (all its replicas).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from splitserve.services.kvstore.master.leases import is_leased
from splitserve.services.kvstore.master.metadata import ObjectMeta, ObjectState


def evictable(lru: "OrderedDict[str, ObjectMeta]", node_id: str, now: float) -> Iterator[ObjectMeta]:
    """COMPLETE, unleased objects with a replica on ``node_id``, least recently used first."""
    for obj in lru.values():
        if obj.state is ObjectState.COMPLETE and not is_leased(obj, now) and obj.replica_on(node_id) is not None:
            yield obj


def bytes_to_free(used: int, incoming: int, capacity: int, high: float, low: float) -> int:
    """How many bytes to evict before putting ``incoming`` bytes into a segment (0 below the high mark)."""
    if used + incoming <= high * capacity:
        return 0
    return max(0, int(used + incoming - low * capacity))


def pick_victims(lru: "OrderedDict[str, ObjectMeta]", node_id: str, need_bytes: int, now: float, aligned) -> list[ObjectMeta]:
    """Least recently used evictable objects on ``node_id`` whose replicas there add up to ``need_bytes``
    (fewer if not enough are evictable). ``aligned(size)`` gives the bytes a replica occupies."""
    victims: list[ObjectMeta] = []
    freed = 0
    if need_bytes <= 0:
        return victims
    for obj in evictable(lru, node_id, now):
        victims.append(obj)
        freed += aligned(obj.size)
        if freed >= need_bytes:
            break
    return victims
