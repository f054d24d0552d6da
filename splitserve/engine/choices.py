"""n > 1 on one engine: the choices of a request share one prefill and the prompt's KV blocks.

``AsyncEngine.prefill`` samples the first token of every choice (``params.for_choice(i)``) from the last prompt
position's logits. ``AsyncEngine.decode_prefilled`` then forks the choices that did not end at their first token:
one DECODE_PREFILLED sequence each (same request_id, its ``index``), sharing the prompt's full KV blocks (one
reference per child) and each owning a copy of the partial last block, copied on the engine thread at fork
time (``EngineCore.fork``), so no child ever writes into a block another one reads.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, AsyncIterator

from splitserve.engine.core import RequestOutput
from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from splitserve.engine.async_engine import AsyncEngine


async def generate_choices(engine: AsyncEngine, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """n > 1 here: one prefill, its first tokens as outputs (index i), then the forked choices' decode."""
    pre = await engine.prefill(request_id, prompt_token_ids, params)
    firsts = [RequestOutput(request_id, [tok], reason, cached_tokens=pre.cached_tokens, index=i,
                            logprobs=None if pre.first_logprobs is None else [pre.first_logprobs[i]])
              for i, (tok, reason) in enumerate(zip(pre.first_token_ids, pre.finish_reasons))]
    firsts[0].prompt_logprobs = pre.prompt_logprobs
    if pre.blocks is None:
        for out in firsts:
            yield out
        return
    async with pre.blocks as blocks:  # freed if the consumer stops before the decode takes them
        for out in firsts:
            yield out
        stream = engine.decode_prefilled(request_id, prompt_token_ids, params, pre.first_token_ids, blocks)
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                yield out


async def fork_stream(engine: AsyncEngine, children: list[Sequence], blocks: OwnedBlocks) -> AsyncIterator[RequestOutput]:
    """Allocate the copy-on-write blocks of choices 1.. (the prompt blocks past the last full computed one,
    usually just the partial last block), then fork ``children`` over ``blocks`` (``EngineCore.fork``)."""
    tail = len(blocks.block_ids) - children[0].num_computed_tokens // engine.config.block_size
    need = tail * (len(children) - 1)
    copies = await engine.allocate_blocks(need) if need else OwnedBlocks([], engine.core)
    async with copies:
        async with contextlib.aclosing(engine.run_sequences(children, blocks, copies)) as outputs:
            async for out in outputs:
                yield out
