"""Read leases: a reader is granted ``ttl_s`` during which the object is neither removed nor evicted.

A lease is one deadline per object (the latest grant wins); it is granted by GetReplicaList and checked by
Remove and eviction. The *reader* checks its own deadline once the bytes have arrived (client side, see
``splitserve.kvstore.client``): a read that finished late reports LEASE_EXPIRED and its bytes are not used.
"""

from __future__ import annotations

from splitserve.services.kvstore.master.metadata import ObjectMeta


def grant(obj: ObjectMeta, now: float, ttl_s: float) -> float:
    """Extend ``obj``'s lease to at least ``now + ttl_s``; returns the granted duration in seconds."""
    obj.lease_until = max(obj.lease_until, now + ttl_s)
    return ttl_s


def is_leased(obj: ObjectMeta, now: float) -> bool:
    return obj.lease_until > now
