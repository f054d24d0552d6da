"""What ``AsyncEngine.prefill`` returns (one prefill, the first token of every choice, the prompt's KV blocks)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.engine.owned_blocks import OwnedBlocks


@dataclass(slots=True)
class PrefillOutput:
    """What ``AsyncEngine.prefill`` returns: the first token of each of the ``params.n`` choices and, unless every
    choice finished at prefill, the prompt's KV blocks, owned by the caller.

    Attributes:
        first_token_ids: choice i's first token (sampled with ``params.for_choice(i)``), ``n`` entries.
        finish_reasons: per choice, set when that choice ended at its first token (EOS, a stop id, max_tokens 1).
        cached_tokens: leading prompt tokens whose KV was handed in (``cached``), not computed.
        blocks: ``ceil(prompt tokens / block_size)`` blocks; None when every choice finished.
        first_logprobs: with ``params.logprobs``, each first token's TokenLogprob (``n`` entries); else None.
        prompt_logprobs: with ``params.prompt_logprobs``, one entry per prompt token (the first None); else None.
    """

    request_id: str
    first_token_ids: list[int]
    finish_reasons: list[str | None]
    cached_tokens: int
    blocks: OwnedBlocks | None
    first_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def first_token_id(self) -> int:
        """Choice 0's first token (the only one when n is 1)."""
        return self.first_token_ids[0]

    @property
    def finish_reason(self) -> str | None:
        """None while any choice continues (``blocks`` is then set); else choice 0's finish_reason."""
        return None if any(r is None for r in self.finish_reasons) else self.finish_reasons[0]
