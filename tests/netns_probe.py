"""Run inside a network namespace by tests/test_deploy_netns.py: stream one greedy generation from the router over
gRPC (HTTP too) and read the workers' counters. Prints one JSON object.

usage: python -m tests.netns_probe ROUTER_GRPC ROUTER_HTTP_BASE PREFILL_GRPC DECODE_GRPC
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import httpx
from pd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from splitserve.client import RouterClient


async def _stats(address: str, stub_cls) -> dict:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=10)
    return dict(resp.counters)


async def _in_rotation(http_base: str, timeout_s: float = 60.0) -> None:
    """Until the router lists every worker as up: before that it may prefill on the decode worker (no UCX bytes)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(base_url=http_base, timeout=5) as http:
        while True:
            try:
                view = (await http.get("/v1/workers")).json()["workers"]
                if view and all(w.get("state") == "up" for w in view):
                    return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"workers not all up in the router after {timeout_s} s")
            await asyncio.sleep(0.2)


async def main(router_grpc: str, http_base: str, prefill: str, decode: str) -> dict:
    await _in_rotation(http_base)
    before = await _stats(prefill, prefill_pb2_grpc.PrefillServiceStub), await _stats(decode, decode_pb2_grpc.DecodeServiceStub)
    ids, text = [], ""
    async with RouterClient(router_grpc) as client:
        async for delta in client.generate("Once upon a time, " * 12, max_tokens=12, temperature=0, ignore_eos=True):
            ids += delta.token_ids
            text += delta.text
    async with httpx.AsyncClient(base_url=http_base, timeout=60) as http:
        resp = await http.post("/v1/completions", json={"model": "TinyStories-656K", "prompt": "Once upon a time",
                                                        "max_tokens": 12, "temperature": 0})
    after = await _stats(prefill, prefill_pb2_grpc.PrefillServiceStub), await _stats(decode, decode_pb2_grpc.DecodeServiceStub)
    return {"ids": ids, "text": text, "http_status": resp.status_code, "http_text": resp.json()["choices"][0]["text"]
            if resp.status_code == 200 else resp.text,
            "ucx_bytes_sent": after[0]["ucx_bytes_sent"] - before[0]["ucx_bytes_sent"],
            "ucx_bytes_received": after[1]["ucx_bytes_received"] - before[1]["ucx_bytes_received"]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
