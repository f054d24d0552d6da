"""Python client for the router's gRPC API (pd.v1.RouterService)."""

from __future__ import annotations

from typing import AsyncIterator

from collections.abc import Sequence

from pd.v1 import common_pb2, router_pb2, router_pb2_grpc

from splitserve.engine.guided_spec import GuidedSpec
from splitserve.engine.sampling import seed_from_signed
from splitserve.rpc.convert import guided_to_proto
from splitserve.rpc.server import channel
from splitserve.rpc.tls import TlsConfig


class RouterClient:
    """``async with RouterClient("127.0.0.1:50050") as c: async for r in c.generate("Once upon a time"): ...``

    Yields ``pd.v1.GenerateResponse`` messages (text delta, token ids, the choice ``index``, ``logprobs`` when asked;
    ``prompt_logprobs`` on the first when asked; each choice's finish_reason on its last, usage on the very last).
    Raises grpc.aio.AioRpcError with the server's status code on failure (INVALID_ARGUMENT for a bad value: the
    server checks every field).
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
        ignore_eos: bool = False, timeout: float | None = None, n: int = 1, logprobs: int | None = None,
        prompt_logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
        repetition_penalty: float | None = None, min_p: float = 0.0, min_tokens: int = 0,
        logit_bias: dict[int, float] | None = None, bad_words_token_ids: Sequence[Sequence[int]] = (),
        allowed_token_ids: Sequence[int] | None = None, guided: GuidedSpec | None = None,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream one request. The sampling arguments are :class:`splitserve.engine.sampling.SamplingParams`'s
        (``logit_bias`` maps token ids to biases; ``repetition_penalty`` None = off); ``timeout`` in seconds."""
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos, n=n, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, min_p=min_p, min_tokens=min_tokens,
            logit_bias=[common_pb2.LogitBias(token_id=t, bias=b) for t, b in (logit_bias or {}).items()],
            bad_words_token_ids=[common_pb2.TokenIdSequence(ids=list(w)) for w in bad_words_token_ids],
        )
        if seed is not None:  # a signed 64-bit seed, as over HTTP (ValueError outside it)
            sampling.seed = seed_from_signed(seed)
        if repetition_penalty is not None:
            sampling.repetition_penalty = repetition_penalty
        if allowed_token_ids is not None:
            sampling.allowed_token_ids.ids.extend(allowed_token_ids)
        if logprobs is not None:
            sampling.logprobs = logprobs
        if prompt_logprobs is not None:
            sampling.prompt_logprobs = prompt_logprobs
        if guided is not None:
            sampling.guided.CopyFrom(guided_to_proto(guided))
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
