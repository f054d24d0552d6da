"""What tracing costs on the decode path: no telemetry code vs OTEL_SDK_DISABLED=true vs tracing on.

One run measures all three, interleaved in rounds, each in a fresh child process (a process can
install only one tracer provider):

* ``bare``     -- no telemetry on the path: no gRPC interceptors, and the servicers' telemetry
                  hooks (prefill/decode/transfer observers) replaced by pass-throughs.
* ``disabled`` -- the shipped code with ``OTEL_SDK_DISABLED=true`` (an OTLP endpoint is set, so
                  only that variable keeps tracing off); Prometheus metrics are still recorded.
* ``enabled``  -- tracing on: interceptors on both sides, every span exported over OTLP/gRPC (default
                  batching) to a receiver in this parent process, every request sampled.

Each child serves PrefillService and DecodeService on loopback gRPC (in-process engines, inproc KV
transfer) and drives them like the router does: Prefill (not timed), then the Decode stream (timed):
inter-token latency of single streams, decode throughput of concurrent streams, and the CPU time the
process spends per token in the concurrent phase (all threads: engines, gRPC, span export; unlike
wall-clock numbers it hardly moves when other programs load the machine).

    python benchmarks/tracing_overhead.py [--rounds 7] [--requests 24] [--max-tokens 64] [--concurrency 8] [--waves 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("bare", "disabled", "enabled")


# ------------------------------------------------------------------------------------------------ child


def _strip_telemetry() -> None:
    """Replace the telemetry hooks on the decode path by pass-throughs (mode ``bare``)."""
    import splitserve.services.decode.server as decode_server
    import splitserve.services.prefill.server as prefill_server
    import splitserve.transfer.inproc as inproc

    class _Nothing:
        nbytes = 0

        def done(self, *args) -> None:
            pass

        def finish(self, *args, **kwargs) -> None:
            pass

    @contextlib.contextmanager
    def _passthrough_cm(*args, **kwargs):
        yield _Nothing()

    decode_server.observe_decode = lambda stream, *a, **k: stream
    decode_server.observe_receive = _passthrough_cm
    prefill_server.observe_prefill = _passthrough_cm
    inproc.start_send = lambda *a, **k: _Nothing()


async def _child(args) -> dict:
    from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    from splitserve.engine.async_engine import AsyncEngine, EngineConfig, set_torch_threads
    from splitserve.model import load_model
    from splitserve.rpc.server import bind, create_server, insecure_channel
    from splitserve.services.decode.server import DecodeServicer
    from splitserve.services.prefill.server import PrefillServicer
    from splitserve.telemetry.interceptors import server_interceptors
    from splitserve.telemetry.tracing import tracing_enabled
    from splitserve.transfer import create_receiver, create_sender

    set_torch_threads(1)
    lm = load_model(args.model)
    p_engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=64, max_num_seqs=args.concurrency))
    d_engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=64, max_num_seqs=args.concurrency))
    await p_engine.start()
    await d_engine.start()
    sender = create_sender("inproc", p_engine.kv_cache, p_engine.layout)
    receiver = create_receiver("inproc", d_engine.kv_cache, d_engine.layout)
    await sender.start()
    await receiver.start()
    (p_server, _), (d_server, _) = create_server(), create_server()  # interceptors iff tracing is on
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(p_engine, sender, "inproc", 30.0), p_server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(d_engine, receiver, "inproc", 10.0), d_server)
    p_port, d_port = bind(p_server, "127.0.0.1", 0), bind(d_server, "127.0.0.1", 0)
    await p_server.start()
    await d_server.start()
    p_ch, d_ch = insecure_channel(f"127.0.0.1:{p_port}"), insecure_channel(f"127.0.0.1:{d_port}")
    prefill, decode = prefill_pb2_grpc.PrefillServiceStub(p_ch), decode_pb2_grpc.DecodeServiceStub(d_ch)
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    counter = iter(range(10**9))

    async def one() -> tuple[float, list[float], int]:
        """Decode duration, inter-token gaps and tokens of one request (prefill not timed)."""
        rid = f"bench-{next(counter)}"
        prompt = [1 + (next(counter) % 200) for _ in range(40)]
        resp = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
        t0 = last = time.perf_counter()
        gaps, tokens = [], 0
        async for msg in decode.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                                                kv_handle=resp.kv_handle, first_token_id=resp.first_token_id)):
            now = time.perf_counter()
            if tokens:
                gaps.append(now - last)
            last = now
            tokens += len(msg.token_ids)
        return last - t0, gaps, tokens

    for _ in range(3):  # warm-up
        await one()
    gaps: list[float] = []
    for _ in range(args.requests):
        gaps += (await one())[1]
    t0, cpu0 = time.perf_counter(), time.process_time()
    results = []
    for _ in range(args.waves):
        results += await asyncio.gather(*(one() for _ in range(args.concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(r[2] for r in results)
    out = {
        "tracing": tracing_enabled(), "interceptors": len(server_interceptors()),
        "itl_p50_us": statistics.median(gaps) * 1e6, "itl_mean_us": statistics.fmean(gaps) * 1e6,
        "concurrent_tok_s": tokens / wall,
        "cpu_us_per_token": cpu / tokens * 1e6,  # all threads of the process (prefill too): robust to other load
    }
    await p_ch.close()
    await d_ch.close()
    await p_server.stop(0)
    await d_server.stop(0)
    await sender.close()
    await receiver.close()
    await p_engine.stop()
    await d_engine.stop()
    return out


def child_main(args) -> None:
    from splitserve.telemetry.tracing import setup_tracing

    if args.child == "bare":
        _strip_telemetry()
    setup_tracing("bench-decode")
    print(json.dumps(asyncio.run(_child(args))), flush=True)


# ------------------------------------------------------------------------------------------------ parent


def run_child(mode: str, args, endpoint: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PD_LOG_LEVEL"] = "WARNING"
    if mode in ("disabled", "enabled"):
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    if mode == "disabled":
        env["OTEL_SDK_DISABLED"] = "true"
    argv = [sys.executable, __file__, "--child", mode, "--model", args.model, "--requests", str(args.requests),
            "--max-tokens", str(args.max_tokens), "--concurrency", str(args.concurrency), "--waves", str(args.waves)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from splitserve.paths import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="each mode runs once per round, in rotating order")
    ap.add_argument("--requests", type=int, default=24, help="sequential requests for the ITL measurement")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once for the throughput measurement")
    ap.add_argument("--waves", type=int, default=6, help="rounds of --concurrency streams for the throughput measurement")
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args)
        return

    from splitserve.telemetry.receiver import OTLPReceiver

    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with OTLPReceiver() as receiver:
        for r in range(args.rounds):
            for mode in MODES[r % 3:] + MODES[: r % 3]:
                before = len(receiver.spans())
                res = run_child(mode, args, receiver.endpoint)
                res["spans_exported"] = len(receiver.spans()) - before
                runs[mode].append(res)
                print(f"round {r + 1} {mode:9s} itl p50 {res['itl_p50_us']:7.1f} us  mean {res['itl_mean_us']:7.1f} us  "
                      f"{res['concurrent_tok_s']:8.1f} tok/s  {res['cpu_us_per_token']:7.1f} cpu us/token  "
                      f"interceptors {res['interceptors']}  spans {res['spans_exported']}", flush=True)

    keys = [("itl_p50_us", "ITL p50 us", min), ("concurrent_tok_s", "tok/s", max), ("cpu_us_per_token", "cpu us/token", min)]
    print(f"\nDecode path, {args.model}: {args.rounds} rounds; ITL from {args.requests} sequential streams of "
          f"{args.max_tokens} tokens, throughput and CPU from {args.waves} x {args.concurrency} concurrent streams\n")
    for title, pick in (("median over rounds", statistics.median), ("best round (least disturbed by other load)", None)):
        print(f"{title}:")
        print(f"  {'mode':9s}" + "".join(f"{label:>14s}{'/ bare':>8s}" for _, label, _ in keys))
        for mode in MODES:
            row = f"  {mode:9s}"
            for key, _, best in keys:
                agg = pick or best
                v, b = agg(x[key] for x in runs[mode]), agg(x[key] for x in runs["bare"])
                row += f"{v:14.1f}{v / b:8.3f}"
            print(row)
    spread = {m: (min(x["concurrent_tok_s"] for x in runs[m]), max(x["concurrent_tok_s"] for x in runs[m])) for m in MODES}
    print("tok/s range over rounds: " + ", ".join(f"{m} {lo:.0f}-{hi:.0f}" for m, (lo, hi) in spread.items()))
    print(f"spans exported per enabled run: {[x['spans_exported'] for x in runs['enabled']]}")


if __name__ == "__main__":
    main()
