"""KV store benchmark (prints numbers; not a test).

1. Trace replay: the ``hash_ids`` of the Mooncake FAST'25 synthetic trace (../shared/traces, 3,993
   requests, one id per 512-token prompt block) against the real store -- a master and one storage node
   as separate processes, objects moved over UCX -- at several capacities. Per request, in arrival
   order: a prefix lookup (leading run of stored blocks = hits, read back over UCX with lease and
   checksum checks), then a two-phase put of the missing blocks. Printed beside the infinite-cache
   reuse of the trace (a block is reusable if the same block appeared in any earlier request).
   Scaling: token lengths are not used (hit rates depend only on block identity); each trace block is
   one object of ``--object-kb`` KiB (512 tokens / 32 = one 16-token TinyStories block is 16 KiB; the
   default 4 KiB keeps capacities in RAM). Time is compressed: requests run back to back, with read
   leases of ``--lease-s`` (wall clock) so leases protect only reads in flight, as in real time.
2. Put/get throughput through UCX for blocks of realistic size (one client process, one storage node
   process, one replica): batch put (PutStart + UCX writes + PutEnd) and batch get (lookup + UCX reads
   + checksum), beside the raw data plane (no master) and memcpy. A batch of consecutive blocks that the
   master placed consecutively travels as one UCX message.

    python benchmarks/kvstore_trace.py [--requests N] [--capacities 0.02,0.05,...] [--object-kb 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"

from splitserve.kvstore.client import KVStoreClient, ObjectLocation  # noqa: E402
from splitserve.launcher import Cluster, store_children  # noqa: E402
from splitserve.transfer import apply_ucx_env_defaults  # noqa: E402

ENV = {"UCX_NET_DEVICES": "lo", "PD_LOG_LEVEL": "WARNING"}


def load_trace(path: Path, limit: int | None) -> list[list[int]]:
    reqs = [json.loads(line)["hash_ids"] for line in path.open()]
    return reqs[:limit] if limit else reqs


def chained_keys(hash_ids: list[int]) -> list[str]:
    """Store keys chained like splitserve.kvstore.block_hash (parent || id), so a key names a prefix."""
    keys, parent = [], b"trace/v1"
    for h in hash_ids:
        parent = xxhash.xxh3_128_digest(parent + h.to_bytes(8, "little"))
        keys.append(parent.hex())
    return keys


def infinite_cache(reqs: list[list[int]]) -> tuple[float, float, int, int]:
    """(share of blocks seen before anywhere, share in the leading seen run, total blocks, unique blocks)."""
    seen: set[int] = set()
    repeat = prefix = total = 0
    for ids in reqs:
        total += len(ids)
        repeat += sum(1 for h in ids if h in seen)
        run = 0
        for h in ids:
            if h not in seen:
                break
            run += 1
        prefix += run
        seen.update(ids)
    return repeat / total, prefix / total, total, len(seen)


def start_store(segment_mb: int, master_args: list[str]) -> tuple[Cluster, str]:
    children, master = store_children("127.0.0.1", 1, master_args, ["--segment-mb", str(segment_mb)])
    cluster = Cluster(children, ENV)
    cluster.start()
    try:
        cluster.wait_healthy(timeout_s=120)
    except Exception:
        cluster.stop()
        raise
    return cluster, master


async def replay(master: str, reqs: list[list[int]], obj: int) -> dict[str, float]:
    client = KVStoreClient(master)
    await client.start()
    longest = max(len(ids) for ids in reqs)
    # Per-request buffers are consecutive slices of one pool, like the KV blocks of one request in an engine's
    # cache, so a run of blocks the master placed consecutively moves as one UCX message.
    pool = np.random.default_rng(0).integers(0, 256, longest * obj, dtype=np.uint8)
    bufs = [pool[i * obj : (i + 1) * obj] for i in range(longest)]
    hits = total = put_failed = 0
    read_failed: Counter[str] = Counter()
    t0 = time.perf_counter()
    try:
        for ids in reqs:
            keys = chained_keys(ids)
            total += len(keys)
            found = [r for r in await client.lookup(keys, prefix=True) if isinstance(r, ObjectLocation)]
            ok = 0
            for err in await client.read(found, bufs[: len(found)]):  # read the hits back over UCX
                if err is not None:
                    read_failed[type(err).__name__] += 1
                    break
                ok += 1
            hits += ok
            missing = keys[ok:]
            if missing:
                report = await client.put(missing, bufs[ok : len(keys)])
                put_failed += len(report.failed)
    finally:
        await client.close()
    failed = ",".join(f"{k}:{v}" for k, v in read_failed.items()) or "0"
    return {"hit": hits / total, "seconds": time.perf_counter() - t0, "put_failed": put_failed, "read_failed": failed}


async def throughput(master: str, size: int, count: int, rounds: int) -> dict[str, float]:
    client = KVStoreClient(master, io_timeout_s=60)
    await client.start()
    # Objects are consecutive slices of one pool, as KV blocks of an engine's cache (runs merge into one message).
    src_pool = np.random.default_rng(1).integers(0, 256, size * count, dtype=np.uint8)
    dst_pool = np.zeros(size * count, np.uint8)
    srcs = [src_pool[i * size : (i + 1) * size] for i in range(count)]
    dsts = [dst_pool[i * size : (i + 1) * size] for i in range(count)]
    put_s, get_s, raw_w, raw_r = [], [], [], []
    try:
        for r in range(rounds):
            keys = [f"tp-{size}-{r}-{i}" for i in range(count)]
            t = time.perf_counter()
            report = await client.put(keys, srcs)
            put_s.append(time.perf_counter() - t)
            if report.failed:
                raise RuntimeError(f"put failed: {next(iter(report.failed.values()))}")
            t = time.perf_counter()
            locs = await client.lookup(keys)
            errors = await client.read(locs, dsts)
            get_s.append(time.perf_counter() - t)
            if any(errors) or not np.array_equal(dsts[-1], srcs[-1]):
                raise RuntimeError(f"get failed: {errors}")
            ranges = [(loc.replicas[0].offset, buf) for loc, buf in zip(locs, srcs)]
            ep = locs[0].replicas[0].endpoint
            t = time.perf_counter()
            await client.data.write(ep, ranges, 60)
            raw_w.append(time.perf_counter() - t)
            t = time.perf_counter()
            await client.data.read(ep, [(o, d) for (o, _), d in zip(ranges, dsts)], 60)
            raw_r.append(time.perf_counter() - t)
            for k in keys:
                await client.remove(k, ignore_lease=True)
    finally:
        await client.close()
    total = size * count
    gbps = lambda xs: total / sorted(xs)[len(xs) // 2] / 1e9  # noqa: E731 - median
    return {"put": gbps(put_s), "get": gbps(get_s), "raw_write": gbps(raw_w), "raw_read": gbps(raw_r)}


def memcpy_gbps(size: int, count: int) -> float:
    srcs = [np.ones(size, np.uint8) for _ in range(count)]
    dsts = [np.empty(size, np.uint8) for _ in range(count)]
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for s, d in zip(srcs, dsts):
            np.copyto(d, s)
        best.append(time.perf_counter() - t)
    return size * count / sorted(best)[1] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=0, help="replay only the first N requests (0: all)")
    ap.add_argument("--capacities", default="0.02,0.05,0.1,0.25,0.5,1.0", help="store capacity as a fraction of the trace's unique blocks")
    ap.add_argument("--object-kb", type=int, default=4)
    ap.add_argument("--lease-s", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=5, help="throughput rounds per size (the median is printed)")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    a = ap.parse_args()
    os.environ.update(ENV)
    apply_ucx_env_defaults()
    obj = a.object_kb * 1024
    master_args = ["--lease-s", str(a.lease_s), "--evict-high", "0.95", "--evict-low", "0.9"]

    if not a.skip_trace:
        reqs = load_trace(a.trace, a.requests or None)
        rep, pre, total, unique = infinite_cache(reqs)
        print(f"trace {a.trace.name}: {len(reqs)} requests, {total} blocks (512 tokens each), {unique} unique")
        print(f"infinite cache: {rep:.1%} of blocks repeat an earlier block; {pre:.1%} are in a request's leading run of seen blocks")
        print(f"objects of {a.object_kb} KiB, 1 storage node, eviction 95% -> 90%, read lease {a.lease_s} s, time compressed\n")
        print(f"{'capacity':>9} {'blocks':>8} {'segment':>9} {'block hit rate':>15} {'vs infinite':>12} {'req/s':>7}  failed puts / reads not used")
        for frac in (float(x) for x in a.capacities.split(",")):
            blocks = max(1, int(frac * unique))
            segment_mb = max(1, -(-int(blocks * obj / 0.9) // 2**20))  # the 90% low mark holds `blocks` objects
            cluster, master = start_store(segment_mb, master_args)
            try:
                r = asyncio.run(replay(master, reqs, obj))
            finally:
                cluster.stop()
            print(f"{frac:>9.0%} {blocks:>8} {segment_mb:>6} MiB {r['hit']:>15.1%} {r['hit'] / pre:>12.2f} "
                  f"{len(reqs) / r['seconds']:>7.0f}  {r['put_failed']} / {r['read_failed']}", flush=True)

    if not a.skip_throughput:
        print(f"\nput/get throughput through UCX (1 client process, 1 storage node process, 1 replica, median of {a.rounds} rounds;"
              " objects are consecutive slices of one buffer, like KV blocks of a cache):")
        print(f"{'object':>22} {'count':>6} {'put GB/s':>9} {'get GB/s':>9} {'raw write':>10} {'raw read':>9} {'memcpy':>7}")
        cases = [("16 KiB (TinyStories)", 16 * 1024, 512), ("2 MiB (Llama-3-8B bf16)", 2 * 2**20, 64), ("8 MiB", 8 * 2**20, 16)]
        cluster, master = start_store(512, ["--lease-s", "5"])
        try:
            for name, size, count in cases:
                r = asyncio.run(throughput(master, size, count, a.rounds))
                print(f"{name:>22} {count:>6} {r['put']:>9.2f} {r['get']:>9.2f} {r['raw_write']:>10.2f} {r['raw_read']:>9.2f} "
                      f"{memcpy_gbps(size, count):>7.2f}", flush=True)
        finally:
            cluster.stop()
        print("(put = PutStart + UCX writes + xxh3 checksums + PutEnd; get = lookup with leases + UCX reads + checksum "
              "verification; raw = the UCX data plane alone; 2 MiB = 16 tokens x 32 layers x 2 x 8 KV heads x 128 x 2 bytes)")


if __name__ == "__main__":
    main()
