"""Colocated generation: prefill and decode on one in-process engine (the correctness reference)."""

from __future__ import annotations

from typing import AsyncIterator

from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.backend import TokenEvent


class LocalBackend:
    """GenerationBackend over an AsyncEngine in this process."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def ready(self) -> bool:
        return True

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Tokens of the local engine (with choice index, logprobs and prompt logprobs as the engine gives them).
        ``deadline`` needs no propagation here: the caller enforces it."""
        stream = self.engine.generate(request_id, prompt_token_ids, params)
        try:
            async for out in stream:
                yield TokenEvent(out.token_ids, out.finish_reason, out.cached_tokens, out.index, out.logprobs, out.prompt_logprobs)
        finally:
            await stream.aclose()
