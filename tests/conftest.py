import pytest

from tests.cluster import Colocated, start_cluster


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
