"""One owner per reference on a set of KV blocks, so an error path can neither leak nor double-free them.

An :class:`OwnedBlocks` holds one engine reference on each of its KV blocks and drops it exactly once:

* ``free()`` drops it now (idempotent: a second call, or one after the blocks were handed on, does nothing);
* ``async with blocks:`` frees on exit unless the blocks were handed on inside the block;
* handing the blocks on consumes this owner: to the engine (``AsyncEngine.prefill(cached=...)``,
  ``AsyncEngine.decode_prefilled``: :meth:`take`) or to another holder such as a KV lease or a store write
  (:meth:`move`). After that ``free()`` is a no-op, and ``block_ids``, ``take``, ``move``, ``share`` and
  ``truncate`` raise :class:`BlocksReleased`;
* ``share()`` takes one more reference on (some of) the blocks and returns its own owner (e.g. for a
  background KV store write that may outlive the request).

Frees and increfs are queued to the engine-core thread (``EngineCore.free`` / ``EngineCore.incref``), in
order, so they are safe from any thread and a block is never reused while a forward pass may still write it.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

logger = logging.getLogger(__name__)


class BlockPool(Protocol):
    """What an owner needs from the engine: both calls are queued to the engine thread and applied in order."""

    def free(self, block_ids: list[int]) -> None: ...

    def incref(self, block_ids: list[int]) -> None: ...


class BlocksReleased(RuntimeError):
    """Use of an :class:`OwnedBlocks` after it was freed or handed on (a bug in the caller, not a request error)."""


_OWNED, _CONSUMED, _FREED = "owned", "consumed", "freed"


class OwnedBlocks:
    """One reference on each of ``block_ids`` (KV block ids of one engine's pool), released exactly once."""

    __slots__ = ("_ids", "_pool", "_state", "_lock")

    def __init__(self, block_ids: list[int], pool: BlockPool) -> None:
        self._ids = list(block_ids)
        self._pool = pool
        self._state = _OWNED
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OwnedBlocks({self._ids}, {self._state})"

    def __len__(self) -> int:
        """Number of blocks (also after release: it only describes what was held)."""
        return len(self._ids)

    @property
    def owned(self) -> bool:
        """True until freed or handed on."""
        return self._state == _OWNED

    @property
    def consumed(self) -> bool:
        """True once handed on (to the engine, a lease or a store write)."""
        return self._state == _CONSUMED

    @property
    def block_ids(self) -> list[int]:
        """The block ids (a copy). Raises BlocksReleased once freed or handed on."""
        self._check("read")
        return list(self._ids)

    def free(self) -> None:
        """Drop the reference (queued to the engine thread). Idempotent; a no-op once handed on."""
        with self._lock:
            if self._state != _OWNED:
                return
            self._state = _FREED
        if self._ids:
            self._pool.free(self._ids)

    def take(self) -> list[int]:
        """Consume this owner and return the raw block ids: the caller (the engine) now drops the reference
        itself. Raises BlocksReleased if already freed or handed on."""
        self._release("hand over", _CONSUMED)
        return list(self._ids)

    def move(self) -> OwnedBlocks:
        """Consume this owner and return a new one holding the same reference (e.g. for a KV lease).
        Raises BlocksReleased if already freed or handed on."""
        self._release("hand over", _CONSUMED)
        return OwnedBlocks(self._ids, self._pool)

    def share(self, start: int = 0, stop: int | None = None) -> OwnedBlocks:
        """One more reference on ``block_ids[start:stop]``, with its own owner (this one is unchanged). The
        incref is queued before any later free, so the blocks stay allocated until both owners released
        them. Raises BlocksReleased if this owner was freed or handed on."""
        with self._lock:
            self._check("share")
            ids = self._ids[start:stop]
            if ids:
                self._pool.incref(ids)
        return OwnedBlocks(ids, self._pool)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` blocks and free the rest (e.g. prefix blocks whose store read failed).
        Raises BlocksReleased if freed or handed on, ValueError if ``n`` is negative."""
        if n < 0:
            raise ValueError(f"cannot keep {n} blocks")
        with self._lock:
            self._check("truncate")
            rest, self._ids = self._ids[n:], self._ids[:n]
        if rest:
            self._pool.free(rest)

    async def __aenter__(self) -> OwnedBlocks:
        return self

    async def __aexit__(self, *exc) -> None:
        self.free()

    def __del__(self) -> None:
        # a safety net for a bug elsewhere (an owner dropped while still owning): say so, and do not leak
        if getattr(self, "_state", None) == _OWNED and self._ids:
            logger.warning("KV blocks %s dropped without free(); freeing them now", self._ids)
            self._pool.free(self._ids)

    def _release(self, what: str, state: str) -> None:
        with self._lock:
            self._check(what)
            self._state = state

    def _check(self, what: str) -> None:
        if self._state != _OWNED:
            raise BlocksReleased(f"cannot {what} KV blocks {self._ids}: already {self._state}")
