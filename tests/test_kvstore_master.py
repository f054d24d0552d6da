"""KVStoreMaster state machine with a fake clock: two-phase puts, leases, eviction, replication,
node death, zombie writes. No I/O, no sleeping."""

import itertools

import pytest

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
from splitserve.services.kvstore.master.config import MasterConfig
from splitserve.services.kvstore.master.core import KVStoreMaster

KB = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def make(nodes=1, segment=64 * KB, **cfg):
    clock = FakeClock()
    m = KVStoreMaster(MasterConfig(**cfg), clock)
    for i in range(nodes):
        m.mount_segment(f"n{i}", f"127.0.0.1:{7000 + i}", segment)
    return m, clock


def put(m, key, size=KB, checksum=1):
    t = m.put_start(key, size)
    m.put_end(key, t.put_id, checksum)
    return t


def check(m):
    for seg in m.segments.values():
        seg.allocator.check_integrity()
    used = {n: 0 for n in m.segments}
    for obj in m.objects.values():
        for r in obj.replicas:
            used[r.node_id] += m.segments[r.node_id].allocator.aligned(r.size)
            assert obj.key in m.segments[r.node_id].keys
    assert used == {n: s.used for n, s in m.segments.items()}


def test_two_phase_put_then_read_with_lease():
    m, clock = make(lease_s=5.0)
    t = m.put_start("k", 3000)
    assert len(t.replicas) == 1 and t.replicas[0].endpoint == "127.0.0.1:7000" and t.replicas[0].size == 3000
    with pytest.raises(ObjectNotReady):
        m.get_replica_list("k")  # PROCESSING is not readable
    assert not m.exist("k")
    m.put_end("k", t.put_id, checksum=42)
    m.put_end("k", t.put_id, checksum=42)  # idempotent
    g = m.get_replica_list("k")
    assert g.checksum == 42 and g.size == 3000 and g.lease_s == 5.0 and g.replicas == t.replicas
    assert m.exist("k")
    with pytest.raises(ObjectHasLease):
        m.remove("k")
    clock.advance(5.01)
    m.remove("k")
    with pytest.raises(ObjectNotFound):
        m.get_replica_list("k")
    assert m.stats()["used_bytes"] == 0
    check(m)


def test_second_writer_of_a_key_gets_already_exists_and_cannot_publish():
    m, _ = make()
    t1 = m.put_start("k", KB)
    with pytest.raises(ObjectAlreadyExists):
        m.put_start("k", KB)  # being written
    m.put_end("k", t1.put_id, 7)
    with pytest.raises(ObjectAlreadyExists):
        m.put_start("k", KB)  # complete
    with pytest.raises(WriteRevoked):
        m.put_end("k", t1.put_id + 99, 8)  # someone else's put id
    assert m.get_replica_list("k").checksum == 7
    assert m.counters["puts_completed"] == 1 and m.counters["puts_rejected_exists"] == 2


def test_put_revoke_frees_space_and_is_only_for_open_writes():
    m, _ = make()
    t = m.put_start("k", KB)
    m.put_revoke("k", t.put_id)
    assert m.stats()["used_bytes"] == 0 and "k" not in m.objects
    with pytest.raises(WriteRevoked):
        m.put_end("k", t.put_id, 1)
    t2 = put(m, "k")
    with pytest.raises(WriteRevoked):
        m.put_revoke("k", t2.put_id)  # already complete


def test_replicas_land_on_distinct_nodes_and_fall_back_to_fewer():
    m, _ = make(nodes=3, default_replicas=2)
    t = m.put_start("k", KB)
    assert len({r.node_id for r in t.replicas}) == 2
    t3 = m.put_start("k3", KB, replicas=5)  # more than there are nodes: one per node
    assert sorted(r.node_id for r in t3.replicas) == ["n0", "n1", "n2"]


def test_eviction_is_lru_between_watermarks_and_skips_leased_and_processing():
    m, clock = make(segment=100 * KB, alignment=KB, evict_high=0.9, evict_low=0.5, lease_s=1.0)
    for i in range(90):  # 90% full, at the high watermark
        put(m, f"k{i}")
        clock.advance(0.01)
    m.get_replica_list("k0")  # k0 becomes most recently used (and leased)
    open_write = m.put_start("zz", KB)  # 91%: over the mark -> evict down to 50%
    # 90 KB + 1 KB > 90% -> free 91 - 50 = 41 KB, least recently used first: k1..k41
    assert m.counters["evicted_objects"] == 41 and m.stats()["used_bytes"] == 50 * KB
    assert m.exist("k0")  # recently used and leased
    assert not any(m.exist(f"k{i}") for i in range(1, 42)) and all(m.exist(f"k{i}") for i in range(42, 90))
    assert "zz" in m.objects and m.objects["zz"].put_id == open_write.put_id
    check(m)


def test_leased_objects_are_never_evicted_even_if_the_put_fails():
    m, clock = make(segment=4 * KB, alignment=KB, lease_s=1.0, evict_high=1.0, evict_low=1.0)
    for i in range(4):
        put(m, f"k{i}")
    for i in range(4):
        m.get_replica_list(f"k{i}")
    with pytest.raises(StoreNoSpace):
        m.put_start("new", KB)
    assert all(m.exist(f"k{i}") for i in range(4))
    clock.advance(1.5)  # leases over: now the LRU object goes
    m.put_start("new", KB)
    assert not m.exist("k0") and m.exist("k3")
    check(m)


def test_fragmented_segment_evicts_until_the_object_fits():
    m, _ = make(segment=8 * KB, alignment=KB, evict_high=1.0, evict_low=1.0)
    for i in range(8):
        put(m, f"k{i}")
    m.remove("k1")
    m.remove("k5")  # 2 KB free, but not contiguous
    t = m.put_start("big", 2 * KB)
    assert t.replicas and m.counters["evicted_objects"] >= 1
    check(m)


def test_dead_node_replicas_are_dropped_and_reads_use_the_survivor():
    m, clock = make(nodes=2, default_replicas=2, heartbeat_timeout_s=3.0, heartbeat_interval_s=1.0)
    put(m, "both")
    m.put_start("open", KB)  # being written on both nodes
    clock.advance(2.0)
    m.heartbeat("n1")
    clock.advance(2.0)  # n0 silent for 4 s, n1 for 2 s
    dead, _ = m.tick()
    assert dead == ["n0"] and list(m.segments) == ["n1"]
    assert [r.node_id for r in m.get_replica_list("both").replicas] == ["n1"]
    assert [r.node_id for r in m.objects["open"].replicas] == ["n1"]
    assert m.heartbeat("n0") is False  # it must mount again
    check(m)


def test_object_lost_with_its_last_replica_and_its_writer_is_told():
    m, clock = make(nodes=1, heartbeat_timeout_s=2.0)
    put(m, "done")
    t = m.put_start("open", KB)
    clock.advance(3.0)
    m.tick()
    with pytest.raises(ObjectNotFound):
        m.get_replica_list("done")
    with pytest.raises(WriteRevoked):
        m.put_end("open", t.put_id, 1)
    with pytest.raises(NoStorageNode):
        m.put_start("x", KB)
    assert m.counters["objects_lost"] == 2


def test_zombie_write_is_reclaimed_after_the_put_timeout():
    m, clock = make(segment=4 * KB, alignment=KB, put_timeout_s=30.0)
    t = m.put_start("z", 4 * KB)  # a writer that dies before PutEnd, holding the whole segment
    clock.advance(29.0)
    m.heartbeat("n0")
    assert m.tick() == ([], [])
    with pytest.raises(ObjectAlreadyExists):
        m.put_start("z", KB)
    with pytest.raises(StoreNoSpace):
        m.put_start("other", KB)  # PROCESSING objects are never evicted
    clock.advance(2.0)
    m.heartbeat("n0")
    assert m.tick() == ([], ["z"])
    assert m.stats()["used_bytes"] == 0 and m.counters["puts_reclaimed"] == 1
    with pytest.raises(WriteRevoked):
        m.put_end("z", t.put_id, 1)  # the zombie wakes up: its write is gone
    put(m, "z")
    check(m)


def test_new_writer_preempts_a_timed_out_write_without_waiting_for_the_sweep():
    m, clock = make(put_timeout_s=10.0)
    old = m.put_start("k", KB)
    clock.advance(11.0)
    new = m.put_start("k", KB)
    assert new.put_id != old.put_id
    with pytest.raises(WriteRevoked):
        m.put_end("k", old.put_id, 1)
    m.put_end("k", new.put_id, 2)
    assert m.get_replica_list("k").checksum == 2


def test_remount_of_a_restarted_node_starts_empty():
    m, _ = make()
    put(m, "k")
    m.mount_segment("n0", "127.0.0.1:7999", 64 * KB)
    assert not m.exist("k") and m.segments["n0"].endpoint == "127.0.0.1:7999" and m.stats()["used_bytes"] == 0


def test_bad_arguments_are_invalid_requests():
    m, _ = make(max_key_bytes=8, max_object_bytes=1000)
    for args in [("", 10), ("k" * 9, 10), ("k", 0), ("k", 1001)]:
        with pytest.raises(InvalidRequest):
            m.put_start(*args)
    with pytest.raises(InvalidRequest):
        m.put_start("k", 10, replicas=17)
    with pytest.raises(InvalidRequest):
        m.mount_segment("n9", "", 10)
    with pytest.raises(ValueError):
        MasterConfig(evict_low=0.95, evict_high=0.9)


# ------------------------------------------------------------------ placement (master.placement)

_KEYS = itertools.count()


def _puts_per_node(m, clock, n: int, size: int = KB, heartbeat: bool = True) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _ in range(n):
        if heartbeat:
            for node_id in list(m.segments):
                m.heartbeat(node_id)
        key = f"spread-{next(_KEYS)}"
        t = m.put_start(key, size)
        m.put_end(key, t.put_id, 0)
        counts[t.replicas[0].node_id] = counts.get(t.replicas[0].node_id, 0) + 1
    return counts


def test_a_restarted_empty_node_does_not_take_every_write():
    import random

    clock = FakeClock()
    m = KVStoreMaster(MasterConfig(), clock, rng=random.Random(0))
    m.mount_segment("n0", "127.0.0.1:7000", 256 * KB)
    m.mount_segment("n1", "127.0.0.1:7001", 256 * KB)
    _puts_per_node(m, clock, 150)  # both well used (weighted by free space, spread over both)
    m.mount_segment("n1", "127.0.0.1:7001", 256 * KB)  # n1 restarts: empty
    counts = _puts_per_node(m, clock, 100)
    assert 0 < counts.get("n0", 0) < counts["n1"] < 100, counts  # the empty node gets more, not all


def test_no_new_replicas_on_a_node_that_missed_a_heartbeat_until_it_beats_again():
    m, clock = make(nodes=2, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    clock.advance(2.5)
    m.heartbeat("n0")  # n1 missed two heartbeats: still listed, but in doubt
    assert set(_puts_per_node(m, clock, 20, heartbeat=False)) == {"n0"}
    m.heartbeat("n1")
    assert set(_puts_per_node(m, clock, 40, heartbeat=False)) == {"n0", "n1"}


def test_a_failed_write_reported_at_revoke_pauses_placement_on_that_node():
    m, clock = make(nodes=2, heartbeat_timeout_s=5.0)
    t = m.put_start("k", KB, replicas=2)
    m.put_revoke("k", t.put_id, failed_node_ids=["n1", "no-such-node"])
    assert m.stats()["placement_pauses"] == 1
    assert set(_puts_per_node(m, clock, 20)) == {"n0"}
    clock.advance(5.1)  # the pause ends (a dead node would have been dropped by now)
    assert set(_puts_per_node(m, clock, 40)) == {"n0", "n1"}


def test_when_every_node_is_in_doubt_writes_still_go_somewhere():
    m, clock = make(nodes=2, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    clock.advance(3.0)  # nobody heartbeats (e.g. the master was busy): placement falls back to every node
    assert sum(_puts_per_node(m, clock, 10, heartbeat=False).values()) == 10
