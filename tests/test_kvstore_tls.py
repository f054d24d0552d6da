"""Mutual TLS on the KV store's gRPC hops, on real processes: router, prefill and decode workers, the store
master and a storage node, all given one PD_TLS_* configuration (as `splitserve up` does).

Over mTLS: the prefill worker stores blocks (a repeated prompt reports cached tokens), the decode worker reads
the prompt's KV from the store (``--kv-transfer-mode store``), the launcher's health checks pass. Refused by
master and node alike: plaintext clients, TLS clients without a certificate or with one from another CA, and a
storage node whose certificate the master does not trust (it never mounts). The store's UCX data plane is not
gRPC and is not encrypted (README, Security).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd.v1 import common_pb2, decode_pb2_grpc, kvstore_pb2_grpc, prefill_pb2_grpc

from splitserve.client import RouterClient
from splitserve.errors import WorkerUnavailable
from splitserve.healthcheck import healthy
from splitserve.kvstore.client import KVStoreClient, ObjectLocation
from splitserve.launcher import Child, free_port
from splitserve.rpc.server import channel
from splitserve.rpc.tls import TlsConfig
from tests.certs import make_pki, tls_env
from tests.cluster import TEST_ENV, grpc_address, read_up_banner, start_cluster
from tests.test_e2e_kvstore import STORIES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B = 16


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls(pki):
    return TlsConfig(pki.cert, pki.key, pki.ca, client_auth=True)


@pytest.fixture(scope="module")
def tls_store(pki):
    """Router, 1 prefill + 1 decode worker in store transfer mode, master, 1 storage node: all over mTLS.
    start_cluster waits for every process to be healthy: the launcher's health checks run over mTLS too. A long
    read lease: this module checks TLS, not UCX timing on a loaded machine."""
    c, base_url, router = start_cluster(worker_args=["--kv-cache-mb", "64", "--kv-transfer-mode", "store"], store_nodes=1,
                                        master_args=["--lease-s", "60"], env=tls_env(pki))
    yield c, base_url, router
    c.stop()


async def stats(address: str, stub_cls, tls: TlsConfig) -> dict[str, float]:
    async with channel(address, tls) as ch:
        return dict((await stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=5)).counters)


async def tokens(router: str, tls: TlsConfig, prompt, max_tokens: int = 16):
    ids, text, usage = [], "", None
    async with RouterClient(router, tls=tls) as client:
        async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            ids += list(r.token_ids)
            text += r.text
            if r.HasField("usage"):
                usage = r.usage
    return ids, text, usage


async def test_store_blocks_are_reused_and_decode_reads_them_over_mutual_tls(tls_store, mtls, colocated):
    cluster, base_url, router = tls_store
    prefill, decode = grpc_address(cluster, "prefill-0"), grpc_address(cluster, "decode-0")
    master, node = grpc_address(cluster, "kvstore-master"), grpc_address(cluster, "kvstore-node-0")
    prompt = STORIES[3]
    cold = await tokens(router, mtls, prompt)
    deadline = time.monotonic() + 10
    while (await stats(prefill, prefill_pb2_grpc.PrefillServiceStub, mtls))["kvstore_writes_in_flight"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    warm = await tokens(router, mtls, prompt)
    n_prompt = cold[2].prompt_tokens
    assert n_prompt > 2 * B
    assert cold[2].cached_tokens == 0 and warm[2].cached_tokens == (n_prompt // B) * B  # the prefix came from the store
    ref = await tokens(colocated.grpc_address, None, prompt)
    assert cold[0] == warm[0] == ref[0] and cold[1] == ref[1]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:  # the HTTP front door (not TLS) sees it too
        r = await http.post("/v1/completions", json={"model": "TinyStories-656K", "prompt": prompt, "max_tokens": 16,
                                                      "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (n_prompt // B) * B
    assert r.json()["choices"][0]["text"] == ref[1]
    p = await stats(prefill, prefill_pb2_grpc.PrefillServiceStub, mtls)
    d = await stats(decode, decode_pb2_grpc.DecodeServiceStub, mtls)
    m = await stats(master, kvstore_pb2_grpc.KVStoreMasterServiceStub, mtls)
    n = await stats(node, kvstore_pb2_grpc.KVStoreNodeServiceStub, mtls)
    assert p["kvstore_cached_tokens"] == 2 * (n_prompt // B) * B
    assert p["kv_bytes_sent"] == 0 and d["kv_bytes_received"] == 0  # nothing pulled from the prefill worker directly
    assert d["kvstore_loaded_tokens"] >= n_prompt  # the decode worker read prompts' KV from the store
    assert m["segments"] == 1 and m["objects"] >= n_prompt // B and m["grpc_bytes_received"] > 0
    assert n["mounted"] == 1 and n["heartbeats_failed"] == 0


async def _check(address: str, tls: TlsConfig | None) -> grpc.aio.AioRpcError:
    ch = channel(address, tls) if tls is not None else grpc.aio.insecure_channel(address)
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return err.value


async def test_master_and_node_refuse_clients_without_a_trusted_certificate(tls_store, pki, mtls):
    cluster, _, _ = tls_store
    refused = {
        "plaintext": None,
        "TLS without a client certificate": TlsConfig(ca_file=pki.ca),
        "client certificate from another CA": TlsConfig(pki.other_cert, pki.other_key, pki.ca),
        "server not trusted": TlsConfig(pki.cert, pki.key, pki.other_ca),
    }
    for name in ("kvstore-master", "kvstore-node-0"):
        address = grpc_address(cluster, name)
        for why, tls in refused.items():
            err = await _check(address, tls)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (name, why, err)
        untrusted = await _check(address, refused["server not trusted"])
        assert "handshake" in untrusted.details().lower() or "certificate" in untrusted.details().lower(), untrusted.details()
        async with channel(address, mtls) as ch:  # the cluster's own certificate passes
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        # the container health check (python -m splitserve.healthcheck) follows PD_TLS_*
        assert healthy(f"grpc:{address}", tls=mtls) and not healthy(f"grpc:{address}")


async def test_store_client_over_mutual_tls_and_a_plaintext_client_fails(tls_store, mtls):
    cluster, _, _ = tls_store
    master = grpc_address(cluster, "kvstore-master")
    plain = KVStoreClient(master, rpc_timeout_s=3)
    await plain.start()
    try:
        with pytest.raises(WorkerUnavailable):
            await plain.lookup(["tls-probe"])
        with pytest.raises(WorkerUnavailable):
            await plain.put_start(["tls-probe"], 64)
    finally:
        await plain.close()
    secure = KVStoreClient(master, tls=mtls)
    await secure.start()
    try:
        data = np.arange(4096, dtype=np.uint8)
        key = f"tls-object-{os.getpid()}"
        report = await secure.put([key], [data])
        assert report.written == [key] and not report.failed
        (loc,) = await secure.lookup([key])
        assert isinstance(loc, ObjectLocation)
        out = np.zeros_like(data)
        assert await secure.read([loc], [out]) == [None] and np.array_equal(out, data)  # control over mTLS, bytes over UCX
    finally:
        await secure.close()


async def test_a_storage_node_with_an_untrusted_certificate_never_mounts(tls_store, pki, mtls):
    cluster, _, _ = tls_store
    master = grpc_address(cluster, "kvstore-master")
    port = free_port()
    rogue = Child("kvstore-node-rogue", [sys.executable, "-m", "splitserve.cli", "kvstore-node", "--master", master,
                                         "--node-id", "rogue", "--port", str(port), "--metrics-port", "-1", "--segment-mb", "1"],
                  f"grpc:127.0.0.1:{port}")
    # it trusts the master's CA, but presents a certificate from another CA
    cluster.start_child(rogue, {"PD_TLS_CERT": pki.other_cert, "PD_TLS_KEY": pki.other_key})
    as_client_of_rogue = TlsConfig(pki.cert, pki.key, pki.other_ca)  # the rogue serves its own certificate
    try:
        deadline = time.monotonic() + 60
        while True:
            assert rogue.proc.poll() is None, "the rogue node exited"
            try:
                s = await stats(f"127.0.0.1:{port}", kvstore_pb2_grpc.KVStoreNodeServiceStub, as_client_of_rogue)
                if s["heartbeats_failed"] >= 2:
                    break
            except grpc.aio.AioRpcError:
                pass  # not listening yet
            assert time.monotonic() < deadline, "the rogue node never tried to mount"
            await asyncio.sleep(0.2)
        assert s["mounted"] == 0 and s["mounts"] == 0
        m = await stats(master, kvstore_pb2_grpc.KVStoreMasterServiceStub, mtls)
        assert m["segments"] == 1  # only the cluster's own node
    finally:
        rogue.proc.send_signal(signal.SIGTERM)
        try:
            rogue.proc.wait(10)
        except subprocess.TimeoutExpired:
            rogue.proc.kill()
            rogue.proc.wait()


def test_up_with_tls_env_brings_up_a_healthy_cluster_with_the_store(pki):
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, **TEST_ENV, **tls_env(pki)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--kv-cache-mb", "32", "--store-mb", "32", "--kv-transfer-mode", "store"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = read_up_banner(proc)
        out = "".join(lines)
        assert "mutual TLS on every gRPC hop" in out, out
        store = [l for l in lines if l.strip().startswith("kvstore-")]
        assert len(store) == 2 and all(" SERVING" in l for l in store), out  # the launcher's checks, over mTLS
        assert "1 segment(s) mounted" in out, out  # the master's stats, over mTLS
        try:
            gen = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--router", f"127.0.0.1:{grpc_port}",
                                  "--max-tokens", "8", "Once upon a time"], capture_output=True, text=True, timeout=60, env=env)
        except subprocess.TimeoutExpired as e:  # once in CI (streamed ', a ' then nothing): show what the cluster logged
            pytest.fail(f"generate hung after {e.output!r}; the cluster logged:\n{''.join(proc.later_lines[-80:])}")
        assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
        plain = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--router", f"127.0.0.1:{grpc_port}",
                                "--max-tokens", "8", "Once upon a time"], capture_output=True, text=True, timeout=60,
                               env={k: v for k, v in env.items() if not k.startswith("PD_TLS_")})
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",
                       json={"model": "TinyStories-656K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].strip() == gen.stdout.strip()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
