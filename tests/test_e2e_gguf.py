"""The GGUF test model through the disaggregated cluster equals colocated, token for token."""

import pytest

from splitserve.paths import MODELS_DIR
from tests.cluster import Colocated, start_cluster
from tests.test_e2e_disaggregated import grpc_tokens

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GGUF = MODELS_DIR / "stories260K.gguf"


async def test_gguf_disaggregated_equals_colocated():
    cluster, _, router_grpc = start_cluster(model=GGUF, worker_args=["--kv-cache-mb", "16", "--block-size", "8"])
    colocated = Colocated(model=GGUF, extra=["--block-size", "8"])
    try:
        for prompt in ("Once upon a time", "Lily and Ben went to the park to play with a big red ball. They"):
            got = await grpc_tokens(router_grpc, prompt, 24)
            ref = await grpc_tokens(colocated.grpc_address, prompt, 24)
            assert got[0] == ref[0] and got[1] == ref[1]
        text = (await grpc_tokens(router_grpc, "Once upon a time", 12))[1]
        assert text.startswith(", there was a little girl named Lily.")
    finally:
        cluster.stop()
        colocated.stop()
