"""KV transfer throughput: memcpy vs raw ucxx send/recv vs the project's KVReceiver.fetch path.

For each payload size (default 4, 64, 256 MiB) this measures, with the same UCX settings
(``ucx_env_defaults()``, ``UCX_NET_DEVICES=lo`` unless ``--net-devices`` says otherwise, listener
endpoints with error handling, ``progress_mode="thread"`` + Python futures):

1. ``memcpy``   -- ``torch`` ``copy_`` of the payload within this process (upper bound on one host);
2. ``raw``      -- a pull with bare ucxx: the receiver posts one ``recv`` into a preallocated buffer,
                   sends a 24-byte request, the server process answers with one ``send`` of the payload;
3. ``project``  -- a sender process with a KV pool and registered transfers; this process fetches them
                   with ``KVReceiver.fetch`` into its own KV pool (contiguous block table: one message);
4. ``frag``     -- the same with a fragmented block table (runs of 4 blocks, shuffled, on both sides),
                   so the payload moves as one UCX message per segment;
5. ``raw k``    -- bare ucxx again, the payload split into as many messages as ``frag`` has segments:
                   what UCX itself charges per message, for comparison with ``frag``.

The four UCX paths are interleaved in every repetition (in a rotating order, with a 2 ms pause before
each pull so the previous peer's completions do not compete with it), so all see the same machine noise.
One warm-up repetition is not counted; the bytes of the last repetition are verified. Prints medians in
GB/s (1 GB = 1e9 bytes), the best run, the project/raw ratios, and the median of the per-repetition
project/raw ratio; ``--json PATH`` also writes every sample. On a small shared VM single runs vary by up
to 10x (two processes' UCX progress and notifier threads on few cores, host contention), so compare
medians over many runs.

Usage: ``python benchmarks/kv_transfer.py [--sizes-mib 4 64 256] [--reps 25] [--json out.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import struct
import sys
import time

# UCX reads its environment when the context is created: set it before anything imports ucxx.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from splitserve.transfer.ucx_runtime import apply_ucx_env_defaults

import torch

MIB = 1 << 20
# 1 MiB per block (16 layers x K,V x 16 tokens x 8 KV heads x 128 dims x bf16).
LAYOUT_FIELDS = dict(model_id="bench", num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
RAW_TAG = 0x5EED << 40
GO = struct.Struct("<QQQ")  # nbytes, tag, number of messages
SETTLE_S = 0.002


# ------------------------------------------------------------------------------------------ raw server


def _raw_server_main(conn, max_nbytes: int, env: dict) -> None:
    os.environ.update(env)
    apply_ucx_env_defaults()
    asyncio.run(_raw_server(conn, max_nbytes))


async def _raw_server(conn, max_nbytes: int) -> None:
    import numpy as np

    from splitserve.transfer import ucx_runtime

    ucx_runtime.acquire()
    import ucxx

    payload = np.full(max_nbytes, 0x5A, dtype=np.uint8)
    stop = asyncio.Event()

    async def handler(ep):
        go = bytearray(GO.size)
        while True:
            try:
                await ep.recv(go)
            except Exception:
                break
            nbytes, tag, k = GO.unpack(go)
            if nbytes == 0:
                break
            bounds = [nbytes * i // k for i in range(k + 1)]
            await asyncio.gather(
                *(ep.send(payload[bounds[i] : bounds[i + 1]], tag=tag + i, force_tag=True) for i in range(k))
            )
        stop.set()

    listener = ucxx.create_listener(handler, port=0)
    conn.send(listener.port)
    await stop.wait()
    await asyncio.sleep(0.1)
    listener.close()
    ucx_runtime.release()


# ------------------------------------------------------------------------------------------ measurements


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_memcpy(nbytes: int, reps: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # warm-up (page faults)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(gbps(nbytes, time.perf_counter() - t0))
    return out


class RawClient:
    def __init__(self, ep, max_nbytes: int) -> None:
        import numpy as np

        self.ep = ep
        self.buf = np.ones(max_nbytes, dtype=np.uint8)  # pages faulted in, like the project's pool
        self.n = 0

    async def pull(self, nbytes: int, k: int = 1) -> float:
        """Seconds to pull ``nbytes`` as ``k`` messages (receives posted first, as the project does)."""
        self.n += 1
        tag = RAW_TAG | (self.n << 20)
        bounds = [nbytes * i // k for i in range(k + 1)]
        t0 = time.perf_counter()
        recvs = [
            asyncio.ensure_future(self.ep.recv(self.buf[bounds[i] : bounds[i + 1]], tag=tag + i, force_tag=True))
            for i in range(k)
        ]
        await asyncio.sleep(0)
        await self.ep.send(bytearray(GO.pack(nbytes, tag, k)))
        await asyncio.gather(*recvs)
        return time.perf_counter() - t0


def reps_for(args, nbytes: int) -> int:
    """Small payloads are noisier (about a millisecond each): measure them three times as often."""
    return args.reps * (3 if nbytes <= 16 * MIB else 1)


async def settle() -> None:
    """Let the previous transfer's peer finish its completions (on 2 cores they compete with the next)."""
    await asyncio.sleep(SETTLE_S)


def table_ids(nblocks: int, fragmented: bool, rng: random.Random, pool_blocks: int) -> tuple[list[int], list[int]]:
    if not fragmented:
        return list(range(nblocks)), list(range(pool_blocks - nblocks, pool_blocks))

    def runs(total: int) -> list[int]:
        starts = list(range(0, total, 4))
        rng.shuffle(starts)
        return [b for s in starts for b in range(s, min(s + 4, total))]

    return runs(pool_blocks)[:nblocks], runs(pool_blocks)[-nblocks:]


async def run_ucx(args, sizes: list[int], results: dict) -> None:
    from splitserve.transfer import create_receiver
    from splitserve.transfer.common import compute_segments
    from splitserve.transfer.kv_cache import allocate_kv_cache
    from splitserve.transfer.layout import KVLayout
    from splitserve.transfer.testing import SenderProcess, block_bytes, expected_block

    layout = KVLayout(**LAYOUT_FIELDS)
    bn = layout.block_nbytes
    max_nbytes = max(sizes)
    pool_blocks = max_nbytes // bn + 32
    env = {"UCX_NET_DEVICES": os.environ["UCX_NET_DEVICES"]}

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    raw_proc = ctx.Process(target=_raw_server_main, args=(child, max_nbytes, env), daemon=True)
    raw_proc.start()
    sender = SenderProcess(layout, pool_blocks, salt=11, env=env)
    sender.start(timeout_s=120)
    if not parent.poll(120):
        raise RuntimeError("raw server did not start")
    raw_port = parent.recv()

    rng = random.Random(0)
    plan = {}  # (size, mode, rep) -> (tid, src, dst)
    for nbytes in sizes:
        nblocks = nbytes // bn
        for mode in ("project", "frag"):
            for rep in range(-1, reps_for(args, nbytes)):  # -1: warm-up
                src, dst = table_ids(nblocks, mode == "frag", rng, pool_blocks)
                tid = f"{mode}-{nbytes}-{rep}"
                sender.register(tid, src)
                plan[(nbytes, mode, rep)] = (tid, src, dst)

    pool = allocate_kv_cache(layout, pool_blocks)
    pool.view(-1).view(torch.uint8).fill_(1)  # fault the pages in now (a serving engine touches its pool early)
    receiver = create_receiver("ucx", pool, layout)
    await receiver.start()  # initialises UCX in this loop (also used by the raw client)
    import ucxx

    raw_ep = await ucxx.create_endpoint("127.0.0.1", raw_port)
    raw = RawClient(raw_ep, max_nbytes)
    try:
        for nbytes in sizes:
            reps = reps_for(args, nbytes)
            r = results.setdefault(f"{nbytes // MIB}MiB", {})
            r.update(bytes=nbytes, raw=[], project=[], frag=[], raw_k=[], frag_segments=[])
            k = len(compute_segments(*plan[(nbytes, "frag", 0)][1:], pool_blocks))
            r["raw_k_messages"] = k
            modes = ["raw", "raw_k", "project", "frag"]
            for rep in range(-1, reps):
                # Interleaved, so all paths see the same machine noise, and in a rotating order, so none
                # always follows the same one (a peer still finishing its completions slows the next pull).
                sample = {}
                for mode in modes[rep % 4 :] + modes[: rep % 4]:
                    await settle()
                    if mode == "raw":
                        sample[mode] = await raw.pull(nbytes)
                        continue
                    if mode == "raw_k":
                        sample[mode] = await raw.pull(nbytes, k)
                        continue
                    tid, src, dst = plan[(nbytes, mode, rep)]
                    t0 = time.perf_counter()
                    got = await receiver.fetch(sender.endpoint, tid, src, dst, 60.0)
                    sample[mode] = time.perf_counter() - t0
                    assert got == nbytes, (got, nbytes)
                    if rep == reps - 1:  # verify the bytes of the last repetition (outside the timing)
                        for sb, db in zip(src, dst):
                            if not torch.equal(block_bytes(pool, db), expected_block(layout, sb, 11)):
                                raise AssertionError(f"{mode} {nbytes}: block {sb}->{db} differs")
                    if mode == "frag" and rep >= 0:
                        r["frag_segments"].append(len(compute_segments(src, dst, pool_blocks)))
                    block_bytes(pool, dst[0]).fill_(1)
                if rep >= 0:
                    for key, seconds in sample.items():
                        r[key].append(gbps(nbytes, seconds))
            assert int(raw.buf[nbytes - 1]) == 0x5A
    finally:
        await raw_ep.send(bytearray(GO.pack(0, 0, 1)))
        await raw_ep.close()
        await receiver.close()
        sender.stop()
        raw_proc.join(10)
        if raw_proc.is_alive():
            raw_proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--json", metavar="PATH", help="also write all samples as JSON")
    ap.add_argument("--net-devices", default="lo", help="UCX_NET_DEVICES if not set (default: lo)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    os.environ.setdefault("UCX_NET_DEVICES", args.net_devices)
    apply_ucx_env_defaults()
    layout_block = 16 * 2 * 16 * 8 * 128 * 2
    sizes = [s * MIB for s in args.sizes_mib]
    for s in sizes:
        if s % layout_block:
            ap.error(f"sizes must be multiples of the 1 MiB block, got {s}")

    results: dict = {}
    for nbytes in sizes:
        results.setdefault(f"{nbytes // MIB}MiB", {})["memcpy"] = bench_memcpy(nbytes, reps_for(args, nbytes))
    asyncio.run(run_ucx(args, sizes, results))

    rows = []
    print(
        f"\nKV transfer on {os.cpu_count()} CPUs, GB/s (1e9 B/s), {args.reps} runs per size "
        f"({3 * args.reps} for sizes <= 16 MiB), interleaved; UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}, "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}, 1 MiB KV blocks"
    )
    for stat_name, stat in (("median", statistics.median), ("best", max)):
        header = (
            f"{stat_name:>6} {'size':>7} | {'memcpy':>6} | {'raw ucxx':>8} | {'project':>7} | {'proj/raw':>8} || "
            f"{'segs':>4} | {'raw k msgs':>10} | {'frag':>6} | {'frag/raw k':>10}"
        )
        print(header)
        print("-" * len(header))
        for key, r in results.items():
            row = {"stat": stat_name, "size": key}
            row.update({m: stat(r[m]) for m in ("memcpy", "raw", "project", "raw_k", "frag")})
            row["ratio"] = row["project"] / row["raw"]
            row["frag_ratio"] = row["frag"] / row["raw_k"]
            # the same ratio per repetition (adjacent runs), which cancels slow drifts of the machine
            row["paired_ratio"] = statistics.median(p / q for p, q in zip(r["project"], r["raw"]))
            row["frag_segments"] = int(statistics.median(r["frag_segments"]))
            rows.append(row)
            print(
                f"{'':>6} {key:>7} | {row['memcpy']:6.2f} | {row['raw']:8.2f} | {row['project']:7.2f} | "
                f"{row['ratio']:8.2f} || {row['frag_segments']:4d} | {row['raw_k']:10.2f} | {row['frag']:6.2f} | "
                f"{row['frag_ratio']:10.2f}"
            )
        print()
    for row in rows:
        if row["stat"] == "median":
            print(f"paired project/raw ratio (median over repetitions), {row['size']}: {row['paired_ratio']:.2f}")
    print("target: project/raw >= 0.8 (contiguous block table: one UCX message per fetch)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "UCXPY_"))},
                    "machine": {
                        "cpus": os.cpu_count(),
                        "python": platform.python_version(),
                        "torch": torch.__version__,
                    },
                    "reps": args.reps,
                    "layout": LAYOUT_FIELDS,
                    "summary": rows,
                    "samples": results,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
