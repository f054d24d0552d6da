"""Multi-turn chat replay: decode-side prefix reuse, delta transfer and the prefill skip, on a real local cluster.

One cluster (1 prefill + 2 decode workers, real processes, KV over UCX): ``decode-0`` runs with
``--enable-prefix-caching``, ``decode-1`` with ``--no-enable-prefix-caching``. One router process per configuration
(``--policy prefix_aware``), each over the prefill worker and one decode worker:

* ``pull``: decode-1 (no prefix cache): every turn is prefilled remotely and its whole prompt's KV is pulled.
* ``delta``: decode-0, ``--skip-prefill-tokens 0``: every turn is prefilled remotely; decode pulls only the blocks
  beyond what its prefix cache holds (the conversation so far).
* ``held``: decode-0, ``--skip-prefill-tokens 4096``: decode holds the conversation so far, so the router skips the
  prefill worker and the decode worker prefills locally, computing only the uncached tail.

Each configuration replays its own conversations (fresh random tokens: no configuration starts warm from another's
run), one request at a time: a system prompt, then per turn a user message; each turn's prompt is the previous
prompt + the previous answer (token ids, as generated) + the new user message. Greedy, ``ignore_eos``.

Per turn it prints: KV bytes the decode worker received (``splitserve:kv_transfer_bytes_total{direction="receive"}``
on its /metrics, read before and after the turn) against the KV bytes of the turn's *new* tokens (those whose KV the
decode worker cannot hold: the user message and the previous answer's last token, whose KV was never computed), and
TTFT (client side, gRPC ``Generate`` sent → first token) of each configuration.

    .venv/bin/python benchmarks/multiturn_prefix.py [--model synthetic:llama-25m] [--conversations 4] [--turns 8]

A text chat through ``/v1/chat/completions`` (the history re-rendered and re-tokenized each turn, router token
continuity on and off): ``benchmarks/multiturn_chat_text.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time

import httpx

from splitserve.client import RouterClient
from splitserve.launcher import Child, Cluster, build_cluster, free_port
from splitserve.model import load_model
from splitserve.transfer.layout import KVLayout

ENV = {"UCX_NET_DEVICES": "lo", "PD_LOG_LEVEL": "WARNING"}
CONFIGS = (("pull", "decode-1", "0"), ("delta", "decode-0", "0"), ("held", "decode-0", "4096"))


def received_bytes(metrics_url: str) -> float:
    """``splitserve:kv_transfer_bytes_total`` with direction="receive", summed over transports."""
    total = 0.0
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("splitserve:kv_transfer_bytes_total{") and 'direction="receive"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_router(cluster: Cluster, model: str, prefill: str, decode: str, skip: str,
                 extra: tuple[str, ...] = ()) -> tuple[Child, str]:
    """A router over one prefill and one decode worker (``extra``: more router flags); returns (child, gRPC address).
    Its HTTP base URL is ``child.health`` less ``/health``."""
    port, http = free_port(), free_port()
    argv = [*cluster.children[0].argv[:3], "router", "--model", model, "--http-port", str(http), "--grpc-port", str(port),
            "--prefill", prefill, "--decode", decode, "--policy", "prefix_aware", "--skip-prefill-tokens", skip,
            "--poll-interval-s", "0.3", *extra]
    child = Child("router", argv, f"http://127.0.0.1:{http}/health")
    cluster.start_child(child)
    cluster.wait_healthy(timeout_s=120, children=[child])
    return child, f"127.0.0.1:{port}"


async def turn(client: RouterClient, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT s, time from the first to the second token s, generated token ids) of one greedy request."""
    t0 = time.perf_counter()
    times, out = [], []
    async for msg in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120):
        times += [time.perf_counter() - t0] * len(msg.token_ids)
        out += msg.token_ids
    return times[0], times[1] - times[0], out


class Conversation:
    """One replayed chat: its prompt so far and the tokens the decode worker holds."""

    def __init__(self, rng: random.Random, system_tokens: int) -> None:
        self.rng = rng
        self.prompt = [rng.randrange(10, 2000) for _ in range(system_tokens)]
        self.held = 0

    async def turn(self, client: RouterClient, metrics_url: str, a) -> tuple[float, float, float, int, int]:
        """One turn: (TTFT s, first-to-second token s, KV bytes received, new tokens, prompt tokens)."""
        self.prompt = self.prompt + [self.rng.randrange(10, 2000) for _ in range(a.user_tokens)]
        before = received_bytes(metrics_url)
        ttft, tt2, out = await turn(client, self.prompt, a.output_tokens)
        row = (ttft, tt2, received_bytes(metrics_url) - before, len(self.prompt) - self.held, len(self.prompt))
        self.held = len(self.prompt) + len(out) - 1  # tokens whose KV the decode worker computed or pulled
        self.prompt = self.prompt + out
        return row


async def replay(routers: dict[str, tuple[str, str]], a) -> dict[str, list[list[tuple]]]:
    """Every configuration's conversations, interleaved turn by turn (pull, delta, held, pull, ...) so that load from
    other processes on the machine hits every configuration alike. ``routers``: name -> (gRPC address, decode metrics)."""
    rows: dict[str, list[list[tuple]]] = {name: [] for name in routers}
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(RouterClient(address)) for name, (address, _) in routers.items()}
        for k, client in enumerate(clients.values()):
            await turn(client, [random.Random(k).randrange(10, 2000) for _ in range(24)], 2)  # warm-up
        for c in range(a.conversations):
            convs = {name: Conversation(random.Random(1000 * k + c), a.system_tokens) for k, name in enumerate(routers)}
            for name in routers:
                rows[name].append([])
            for _ in range(a.turns):
                for name, conv in convs.items():
                    rows[name][-1].append(await conv.turn(clients[name], routers[name][1], a))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:llama-25m")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()

    cluster, _, _ = build_cluster(model=a.model, num_prefill=1, num_decode=2, http_port=0, grpc_port=0, env=ENV,
                                  worker_args=["--kv-cache-mb", "512", "--block-size", str(a.block_size)])
    cluster.children = [c for c in cluster.children if c.name != "router"]
    by_name = {c.name: c for c in cluster.children}
    by_name["decode-0"].argv.append("--enable-prefix-caching")
    by_name["decode-1"].argv.append("--no-enable-prefix-caching")
    mc = load_model(a.model, weights=False).config
    block_nbytes = KVLayout("m", mc.num_layers, mc.num_kv_heads, mc.head_dim, a.block_size, mc.dtype).block_nbytes
    per_token = block_nbytes / a.block_size
    cluster.start()
    routers = []
    try:
        cluster.wait_healthy(timeout_s=180)
        addr = {c.name: c.health.removeprefix("grpc:") for c in cluster.children}
        endpoints = {}
        for name, decode, skip in CONFIGS:
            router, address = start_router(cluster, a.model, addr["prefill-0"], addr[decode], skip)
            routers.append(router)
            endpoints[name] = (address, by_name[decode].metrics)
        results = asyncio.run(replay(endpoints, a))
    finally:
        for router in routers:
            router.proc.terminate()
            router.proc.wait(10)
        cluster.stop()
    report(a, results, block_nbytes, per_token)
    return 0


def report(a, results, block_nbytes: int, per_token: float) -> None:
    print(f"model {a.model}; 1 prefill + 2 decode workers (UCX over lo); {a.conversations} conversations x {a.turns} turns "
          f"per configuration, interleaved; system {a.system_tokens}, user {a.user_tokens}, answer {a.output_tokens} tokens "
          f"per turn; block_size {a.block_size} ({block_nbytes} B per KV block, {per_token:.0f} B per token)\n")
    print("Per turn: KV MB the decode worker received (mean over conversations); delta/new = delta's bytes over the new")
    print("tokens' KV bytes; TTFT and first-to-second-token time (TT2T), medians over conversations, ms")
    print(f"{'turn':>4}{'prompt':>7}{'new':>5}{'pull MB':>8}{'delta MB':>9}{'delta/new':>10}{'held MB':>8}"
          f"{'TTFT pull':>10}{'delta':>7}{'held':>7}{'TT2T pull':>10}{'delta':>7}{'held':>7}")
    med = statistics.median
    for t in range(a.turns):
        col = {n: [conv[t] for conv in results[n]] for n in results}
        mb = {n: statistics.mean(r[2] for r in col[n]) / 1e6 for n in col}
        ttft = {n: med(r[0] for r in col[n]) * 1000 for n in col}
        tt2 = {n: med(r[1] for r in col[n]) * 1000 for n in col}
        ratio = statistics.mean(r[2] / (r[3] * per_token) for r in col["delta"])
        print(f"{t + 1:>4}{med(r[4] for r in col['delta']):>7.0f}{med(r[3] for r in col['delta']):>5.0f}{mb['pull']:>8.2f}"
              f"{mb['delta']:>9.2f}{ratio:>10.2f}{mb['held']:>8.2f}{ttft['pull']:>10.1f}{ttft['delta']:>7.1f}{ttft['held']:>7.1f}"
              f"{tt2['pull']:>10.1f}{tt2['delta']:>7.1f}{tt2['held']:>7.1f}")
    later = {n: [r for conv in results[n] for r in conv[1:]] for n in results}
    ratio = sum(r[2] for r in later["delta"]) / sum(r[3] * per_token for r in later["delta"])
    blocks = sum(r[2] for r in later["delta"]) / block_nbytes
    print(f"\nturns 2..{a.turns}: delta moved {ratio:.2f}x the new tokens' KV bytes ({blocks / len(later['delta']):.1f} blocks "
          f"per turn for {statistics.mean(r[3] for r in later['delta']):.0f} new tokens: the partly held block before the new "
          f"tokens moves only its missing rows, a partial last block only its used ones); pull moved "
          f"{sum(r[2] for r in later['pull']) / sum(r[3] * per_token for r in later['pull']):.2f}x")
    p50 = {n: (med(r[0] for r in later[n]) * 1000, med(r[1] for r in later[n]) * 1000) for n in later}
    for n in ("delta", "held"):
        print(f"turns 2..{a.turns} p50 vs pull: {n} TTFT {p50[n][0]:.1f} / {p50['pull'][0]:.1f} ms = {p50[n][0] / p50['pull'][0]:.2f}x, "
              f"TT2T {p50[n][1]:.1f} / {p50['pull'][1]:.1f} ms = {p50[n][1] / p50['pull'][1]:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
