"""Token continuity on a real cluster (router + 1 prefill + 1 decode worker, KV over UCX): a text chat through
/v1/chat/completions with the default model re-renders its history every turn; with the router's token continuity
each later turn's prompt reuses the ids the model generated, so the decode worker (prefix cache, delta transfer)
pulls about only the new tokens' KV (``splitserve:kv_transfer_bytes_total`` on decode), and every turn's answer
equals a colocated server's for the same request sequence."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve.client import RouterClient

from splitserve.frontend.chat import render_chat
from splitserve.paths import default_model_path
from splitserve.served_model import load_served_model
from tests.cluster import Colocated, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.cluster]

USER_TURNS = ("Write a story about Lily and her ball.", "And then?", "What did Lily do next?")
TARGET = 1.1  # KV bytes moved per turn over the new tokens' KV bytes


@pytest.fixture(scope="module")
def setup():
    cluster, http, _ = start_cluster(store_nodes=0)
    ref = Colocated()
    try:
        yield cluster, http, ref
    finally:
        ref.stop()
        cluster.stop()


async def generated(address: str, prompt: list[int]) -> list[int]:
    """The greedy output ids of ``prompt`` (as the chat turn made them)."""
    ids = []
    async with RouterClient(address) as client:
        async for msg in client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=60):
            ids += msg.token_ids
    return ids


def received(cluster) -> float:
    url = next(c for c in cluster.children if c.name == "decode-0").metrics
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url, timeout=5).text.splitlines()
               if line.startswith("splitserve:kv_transfer_bytes_total{") and 'direction="receive"' in line)


def chat(base_url: str, cluster=None) -> list[tuple[str, int, int, float]]:
    """The 3-turn chat, greedy; per turn (answer, prompt tokens, completion tokens, KV bytes decode received)."""
    messages, rows = [], []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for text in USER_TURNS:
            messages.append({"role": "user", "content": text})
            before = received(cluster) if cluster else 0.0
            r = client.post("/v1/chat/completions", json={"model": "TinyStories-656K", "messages": messages,
                                                          "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            answer = body["choices"][0]["message"]["content"]
            rows.append((answer, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"],
                         (received(cluster) - before) if cluster else 0.0))
            messages.append({"role": "assistant", "content": answer})
    return rows


def test_later_chat_turns_move_only_their_new_tokens_kv_with_the_colocated_answers(setup):
    cluster, http, ref = setup
    rows = chat(http, cluster)
    answer1, prompt1, _, bytes1 = rows[0]
    assert answer1.startswith(" ")  # the model's answer keeps its leading space: the history is prompt + answer
    # the case at issue: a fresh encode of turn 2's history does not start with turn 1's prompt + output ids
    tok = load_served_model(str(default_model_path()), None).tokenizer
    turn1 = [{"role": "user", "content": USER_TURNS[0]}]
    ids1 = tok.encode(render_chat(turn1, None))
    out1 = asyncio.run(generated(ref.grpc_address, ids1))
    assert tok.decode(out1) == answer1.lstrip(" ")
    history = render_chat([*turn1, {"role": "assistant", "content": answer1}, {"role": "user", "content": USER_TURNS[1]}], None)
    assert tok.encode(history)[:len(ids1) + len(out1)] != ids1 + out1
    token_nbytes = bytes1 / prompt1  # turn 1 pulls the whole prompt (a partial block only its used rows)
    assert token_nbytes == int(token_nbytes) > 0
    for (_, prev_prompt, prev_completion, _), (_, prompt, _, nbytes) in zip(rows, rows[1:]):
        held = prev_prompt + prev_completion - 1  # KV the decode worker holds (the last sampled token has none)
        new = prompt - held
        assert new > 0
        assert nbytes <= TARGET * new * token_nbytes, (nbytes / token_nbytes, new)
    assert [r[0] for r in rows] == [r[0] for r in chat(ref.base_url)]  # greedy: disaggregated == colocated
