"""The Node.js client (clients/node, @grpc/grpc-js + @grpc/proto-loader loading protos/) against a real cluster:
it streams the same greedy text as the Python client, gets the final finish_reason and usage, and sees gRPC
status codes for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from splitserve.client import RouterClient
from tests.cluster import start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CLIENT = Path(__file__).resolve().parents[1] / "clients" / "node"


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm not installed")
    if not (CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        out = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"npm ci failed:\n{out.stdout}\n{out.stderr}"
    return [node, str(CLIENT / "generate.js")]


def run_node(cmd: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


async def test_node_client_streams_a_generation(cluster, node_client):
    _, router_grpc, _ = cluster
    prompt = "Once upon a time"
    out = run_node(node_client, "--router", router_grpc, "--max-tokens", "24", "--json", prompt)
    assert out.returncode == 0, out.stderr
    responses = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(responses) > 1, "expected a stream of several messages"
    assert len({r["request_id"] for r in responses}) == 1 and responses[0]["request_id"]
    last = responses[-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert all(r["finish_reason"] == "FINISH_REASON_UNSPECIFIED" for r in responses[:-1])
    assert last["usage"]["completion_tokens"] == 24 and last["usage"]["prompt_tokens"] > 0
    node_ids = [int(i) for r in responses for i in r["token_ids"]]
    node_text = "".join(r["text"] for r in responses)

    ids, text = [], ""
    async with RouterClient(router_grpc) as client:
        async for delta in client.generate(prompt, max_tokens=24, temperature=0):
            ids += delta.token_ids
            text += delta.text
    assert node_ids == ids and node_text == text  # greedy: the same tokens through either language's stubs

    plain = run_node(node_client, "--router", router_grpc, "--max-tokens", "24", prompt)
    assert plain.returncode == 0 and plain.stdout == text + "\n"


def test_node_client_sees_grpc_status_codes(cluster, node_client):
    _, router_grpc, _ = cluster
    out = run_node(node_client, "--router", router_grpc, "--max-tokens", "100000", "hi")
    assert out.returncode == 1 and out.stderr.startswith("error: INVALID_ARGUMENT:"), out.stderr
    out = run_node(node_client, "--router", "127.0.0.1:1", "--deadline-ms", "3000", "hi")
    assert out.returncode == 1 and out.stderr.startswith(("error: UNAVAILABLE:", "error: DEADLINE_EXCEEDED:")), out.stderr


def test_node_client_sends_the_api_key(node_client):
    """A router started with an API key: the key from --api-key or PD_API_KEY passes, none is UNAUTHENTICATED."""
    cluster, _, router_grpc = start_cluster(store_nodes=0, router_env={"PD_API_KEY": "node-key-3c9"})
    try:
        out = run_node(node_client, "--router", router_grpc, "--max-tokens", "4", "--api-key", "node-key-3c9", "hi")
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        env = {**os.environ, "PD_API_KEY": "node-key-3c9"}
        out = subprocess.run([*node_client, "--router", router_grpc, "--max-tokens", "4", "hi"], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        env.pop("PD_API_KEY")
        out = subprocess.run([*node_client, "--router", router_grpc, "hi"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 1 and out.stderr.startswith("error: UNAUTHENTICATED:"), out.stderr
    finally:
        cluster.stop()
