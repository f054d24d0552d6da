"""Python client for the router's gRPC API (pd.v1.RouterService)."""

from __future__ import annotations

from typing import AsyncIterator

from pd.v1 import common_pb2, router_pb2, router_pb2_grpc

from splitserve.rpc.server import channel
from splitserve.rpc.tls import TlsConfig


class RouterClient:
    """``async with RouterClient("127.0.0.1:50050") as c: async for r in c.generate("Once upon a time"): ...``

    Yields ``pd.v1.GenerateResponse`` messages (text delta, token ids; finish_reason and usage on the last).
    Raises grpc.aio.AioRpcError with the server's status code on failure.
    """

    def __init__(self, address: str, *, tls: TlsConfig | None = None, api_key: str | None = None) -> None:
        """``tls``: TLS (and a client certificate for mutual TLS) when enabled; ``api_key``: sent as
        ``authorization: Bearer <key>`` metadata on every call."""
        self.channel = channel(address, tls)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def __aenter__(self) -> "RouterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def stats(self, timeout: float = 10.0) -> dict[str, float]:
        """The router's counters (open streams, retries, fallbacks)."""
        resp = await self.stub.GetStats(common_pb2.GetStatsRequest(), timeout=timeout, metadata=self.metadata)
        return dict(resp.counters)

    async def generate(
        self, prompt: str | list[int], *, max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0,
        top_k: int = -1, seed: int | None = None, stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False, timeout: float | None = None,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos,
        )
        if seed is not None:
            sampling.seed = seed
        request = router_pb2.GenerateRequest(sampling=sampling, stop=stop or [])
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.ids.extend(prompt)
        call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
        try:
            async for response in call:
                yield response
        finally:  # closed early, or dropped and finalized: the router aborts the request at once
            call.cancel()
