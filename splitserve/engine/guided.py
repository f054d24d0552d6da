"""Structured outputs: a per-sequence grammar matcher that masks the logits before sampling.

Contract used by the sampler (``splitserve.engine.sampler``) and the engine (one matcher per sequence,
n > 1 forks get one each; on a decode worker the matcher is advanced over the token(s) prefill sampled):

- ``make_matcher(spec, tokenizer, vocab_size)`` compiles (cached per spec) and returns a fresh matcher.
  Raises ``splitserve.errors.InvalidRequest`` for a spec the grammar library refuses.
- ``matcher.fill_mask(mask)``: ``mask`` is a bool tensor ``[vocab_size]``, all True on entry; the matcher
  sets False for every token the grammar forbids next (EOS stays allowed only when the grammar may end).
- ``matcher.accept(token_id) -> bool``: advance over a sampled token; False if the grammar refused it.
- ``matcher.is_terminated() -> bool``: the grammar reached an accepting end (only EOS may follow).
"""

from __future__ import annotations

from typing import Protocol

import torch


class GuidedMatcher(Protocol):
    def fill_mask(self, mask: torch.Tensor) -> None: ...

    def accept(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...
