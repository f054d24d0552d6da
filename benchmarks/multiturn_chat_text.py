"""Multi-turn *text* chat replay through ``/v1/chat/completions``: KV moved per turn with the router's token
continuity on and off, on a real local cluster.

A text chat re-renders its whole history every turn; the front door re-tokenizes it, and with a tokenizer whose
tokens merge across spaces and newlines (the default model's) the history's tokens differ from the ids the model
generated, so the decode worker's prefix cache (matched by token ids) holds less of it. Token continuity
(``--chat-token-continuity``, on by default) encodes a prompt that continues an earlier prompt + answer as that
request's ids + the new text.

One cluster (1 prefill + 2 decode workers, real processes, KV over UCX, prefix caching on both decode workers) and
two routers (``--policy prefix_aware --skip-prefill-tokens 0``: every turn is prefilled remotely, so every turn's
KV crosses the wire and the decode worker pulls only what its prefix cache lacks): ``on`` over decode-0 with token
continuity, ``off`` over decode-1 with ``--no-chat-token-continuity``. Each replays the same conversations (a system
message, then per turn a user message picked by a seeded generator; the history is the client's: each answer as
returned), greedy (an answer ends at EOS or after ``--output-tokens``), one request at a time.

Per turn it prints the KV bytes the decode worker received (``splitserve:kv_transfer_bytes_total{direction=
"receive"}``, read before and after the turn) over the KV bytes of the turn's new tokens: the prompt's tokens
beyond what the decode worker holds of the previous turn (previous prompt + answer tokens, less the last sampled
token whose KV was never computed), counted from the usage the API returns. Target: <= 1.1x.

    .venv/bin/python benchmarks/multiturn_chat_text.py [--model models/TinyStories-656K] [--conversations 4] [--turns 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling benchmark is importable
from multiturn_prefix import ENV, received_bytes, start_router
from splitserve.launcher import build_cluster
from splitserve.model import load_model
from splitserve.paths import default_model_path
from splitserve.served_model import load_served_model
from splitserve.transfer.layout import KVLayout

USER = ("Tell me a story.", "Tell me a story about a girl.", "Hi", "Tell me about the sun.", "And then?", "What did she do next?",
        "Write a story about Lily and her ball.",
        "Who was in the park?", "Why was he sad?", "Tell me about the dog.", "How did it end?", "What is your name?",
        "Can you tell me more?", "Where did they go?", "What happened to the cat?")
CONFIGS = (("on", "decode-0", ()), ("off", "decode-1", ("--no-chat-token-continuity",)))


def conversation(client: httpx.Client, model: str, metrics_url: str, rng: random.Random, a) -> list[tuple[int, int, float]]:
    """One chat of ``a.turns`` turns; per turn (prompt tokens, completion tokens, KV bytes received)."""
    messages = [{"role": "system", "content": "You are a storyteller."}]
    rows = []
    for _ in range(a.turns):
        messages.append({"role": "user", "content": rng.choice(USER)})
        before = received_bytes(metrics_url)
        r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": a.output_tokens,
                                                      "temperature": 0})
        r.raise_for_status()
        body = r.json()
        rows.append((body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"], received_bytes(metrics_url) - before))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()

    cluster, _, _ = build_cluster(model=a.model, num_prefill=1, num_decode=2, http_port=0, grpc_port=0, env=ENV,
                                  worker_args=["--kv-cache-mb", "256", "--block-size", str(a.block_size)])
    cluster.children = [c for c in cluster.children if c.name != "router"]
    by_name = {c.name: c for c in cluster.children}
    for name in ("decode-0", "decode-1"):
        by_name[name].argv.append("--enable-prefix-caching")
    served = load_served_model(a.model, None).name
    cluster.start()
    routers, results = [], {}
    try:
        cluster.wait_healthy(timeout_s=180)
        addr = {c.name: c.health.removeprefix("grpc:") for c in cluster.children}
        for name, decode, extra in CONFIGS:
            router, _ = start_router(cluster, a.model, addr["prefill-0"], addr[decode], "0", extra)
            routers.append(router)
            base = router.health.removesuffix("/health")
            with httpx.Client(base_url=base, timeout=120) as client:
                results[name] = [conversation(client, served, by_name[decode].metrics, random.Random(c), a)
                                 for c in range(a.conversations)]
    finally:
        for router in routers:
            router.proc.terminate()
            router.proc.wait(10)
        cluster.stop()
    mc = load_model(a.model, weights=False).config
    per_token = KVLayout("m", mc.num_layers, mc.num_kv_heads, mc.head_dim, a.block_size, mc.dtype).block_nbytes / a.block_size
    report(a, results, per_token)
    return 0


def ratios(conv: list[tuple[int, int, float]], per_token: float) -> list[float]:
    """KV bytes received over the new tokens' KV bytes (``per_token`` bytes each), per turn; turn 1: its prompt
    tokens beyond the system message's full blocks an earlier conversation left on the decode worker."""
    out = [conv[0][2] / (conv[0][0] * per_token)]
    for (prompt0, completion0, _), (prompt, _, nbytes) in zip(conv, conv[1:]):
        out.append(nbytes / ((prompt - (prompt0 + completion0 - 1)) * per_token))
    return out


def report(a, results, per_token: float) -> None:
    print(f"model {a.model}; 1 prefill + 2 decode workers (UCX over lo, prefix caching on both); text chat through "
          f"/v1/chat/completions, {a.conversations} conversations x {a.turns} turns per configuration, answers of "
          f"{a.output_tokens} tokens, greedy; block_size {a.block_size} ({per_token:.0f} B of KV per token)\n")
    print("KV bytes the decode worker received over the new tokens' KV bytes (mean over conversations; max in brackets)")
    print(f"{'turn':>4}{'prompt on':>10}{'on':>14}{'prompt off':>11}{'off':>14}")
    r = {n: [ratios(conv, per_token) for conv in convs] for n, convs in results.items()}
    for t in range(a.turns):
        cells = []
        for n in ("on", "off"):
            col = [conv[t] for conv in r[n]]
            prompt = statistics.mean(conv[t][0] for conv in results[n])
            cells.append(f"{prompt:>10.0f}{statistics.mean(col):>8.2f} ({max(col):.2f})")
        print(f"{t + 1:>4}{cells[0]}{' ' + cells[1]}")
    for n in ("on", "off"):
        later = [x for conv in r[n] for x in conv[1:]]
        moved = sum(row[2] for conv in results[n] for row in conv[1:])
        new = sum(row[2] / x for conv, rc in zip(results[n], r[n]) for row, x in zip(conv[1:], rc[1:]))
        print(f"turns 2..{a.turns}, token continuity {n}: {moved / new:.2f}x the new tokens' KV bytes overall; per turn "
              f"mean {statistics.mean(later):.2f}x, max {max(later):.2f}x; {sum(x > 1.1 for x in later)} of {len(later)} "
              f"turns above 1.1x")


if __name__ == "__main__":
    raise SystemExit(main())
