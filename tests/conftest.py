"""Fixtures shared by every test module, and the cost markers.

Cost markers (pytest -m): ``unit`` runs in the test process (in-process gRPC on loopback, the tiny model at
most); ``process`` starts a subprocess or two (the CLI, protoc, a spawned KV sender, a lone store process);
``cluster`` starts a cluster of server processes (router + workers, or a KV store). A test gets one from its
module (:data:`CLUSTER_MODULES`, :data:`PROCESS_MODULES`; else ``process`` if it is marked ``integration``,
else ``unit``) unless it is marked itself. ``slow`` and ``integration`` keep their meaning (CI and the README
select on them).
"""

import pytest

from splitserve.paths import default_model_path
from tests.cluster import Colocated, start_cluster

COST_MARKERS = ("unit", "process", "cluster")
CLUSTER_MODULES = {
    "test_bad_input", "test_bench_integration", "test_capacity_cluster", "test_chaos", "test_chaos_kvstore_direct",
    "test_chaos_kvstore_store", "test_client_node", "test_deploy_netns", "test_e2e_disaggregated", "test_e2e_gguf",
    "test_e2e_kvstore", "test_e2e_kvstore_transfer", "test_e2e_openai_sdk", "test_e2e_router_routing", "test_e2e_up",
    "test_kvstore_processes", "test_kvstore_tls", "test_liveness", "test_telemetry_cluster",
    "test_lm_eval", "test_structured_outputs_e2e", "test_api_parity_e2e",
}
PROCESS_MODULES = {
    "test_deploy_compose", "test_kvstore_block_hash", "test_liveness_units", "test_protos_current", "test_telemetry_config",
    "test_transfer_ucx",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if any(item.get_closest_marker(m) for m in COST_MARKERS):
            continue
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in CLUSTER_MODULES:
            item.add_marker("cluster")
        elif module in PROCESS_MODULES or item.get_closest_marker("integration"):
            item.add_marker("process")
        else:
            item.add_marker("unit")


@pytest.fixture(scope="session")
def lm():
    """The embedded default model (TinyStories-656K) with its weights, loaded once per session. Engines of
    different tests share its weights (read-only); each engine has its own KV pool."""
    from splitserve.model import load_model

    return load_model(default_model_path())


@pytest.fixture(scope="session")
def tok():
    """The default model's tokenizer as the frontend's :class:`~splitserve.frontend.testing.SimpleTokenizer`
    (BOS ``<|start_story|>``, EOS ``<|end_story|>``); no weights loaded."""
    from splitserve.frontend.testing import SimpleTokenizer

    return SimpleTokenizer.from_file(str(default_model_path() / "tokenizer.json"), bos_token="<|start_story|>",
                                     eos_token="<|end_story|>")


@pytest.fixture(scope="session")
def cluster():
    """Router + 1 prefill + 1 decode worker as real processes (gRPC control, UCX data)."""
    c, base_url, grpc_address = start_cluster()
    yield base_url, grpc_address, c
    c.stop()


@pytest.fixture(scope="session")
def colocated():
    server = Colocated()
    yield server
    server.stop()


@pytest.fixture
def refs(colocated):
    """Reference completions of the colocated server, cached per prompt (tests/store_chaos.py References)."""
    from tests.store_chaos import References

    return References(colocated)
