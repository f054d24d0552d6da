"""A routed request's prompt and the chained hashes of its full KV blocks, computed once per request.

The prefix_aware policy (:mod:`.policies`) asks for a prompt's block hashes several times per request: picking the
decode and the prefill worker, the prefill skip and the uncached count (:mod:`.prefill_leg`, :mod:`.push_leg`), and
recording what a worker now holds (:mod:`.decode_leg`). :class:`PromptBlocks` hashes each full block once and keeps
the result; :meth:`PromptBlocks.extended` (the prompt plus generated tokens) hashes only the blocks it adds.
"""

from __future__ import annotations

from typing import Sequence

from splitserve.kvstore.block_hash import chain_hashes

ROOT = b"splitserve/router-prefix/v1"  # router-local namespace: the keys never leave the router


class PromptBlocks:
    """Token ids (``token_ids``, a list; ``len()`` is its length in tokens) and their lazily computed block hashes.

    The token ids must not be changed after construction (the cached hashes would no longer match them).
    """

    __slots__ = ("token_ids", "_block_size", "_hashes")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids: list[int] = list(token_ids)
        self._block_size = 0
        self._hashes: list[bytes] = []

    @classmethod
    def of(cls, prompt: PromptBlocks | Sequence[int]) -> PromptBlocks:
        """``prompt`` itself, or its token ids wrapped (hashes not yet computed)."""
        return prompt if isinstance(prompt, PromptBlocks) else cls(prompt)

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> list[bytes]:
        """16-byte chained hashes of every full block of ``block_size`` tokens, in order (``len(self) // block_size``
        of them). Computed on the first call for a block_size, then reused; do not modify the returned list."""
        if block_size != self._block_size:
            self._block_size, self._hashes = block_size, []
        n = len(self.token_ids) // block_size
        have = len(self._hashes)
        if have < n:
            parent = self._hashes[-1] if have else ROOT
            self._hashes = self._hashes + chain_hashes(parent, self.token_ids[have * block_size : n * block_size],
                                                       block_size)
        return self._hashes

    def extended(self, token_ids: Sequence[int]) -> PromptBlocks:
        """These token ids followed by ``token_ids`` (e.g. the tokens generated for the prompt); the hashes already
        computed here are reused, so only the blocks the new tokens complete are hashed."""
        out = PromptBlocks(self.token_ids + list(token_ids))
        out._block_size, out._hashes = self._block_size, self._hashes
        return out
