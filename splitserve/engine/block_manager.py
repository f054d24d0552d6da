"""KV block allocator: free list and reference counts over block ids (plain ints, no torch).

Allocation prefers one run of consecutive block ids: with the block-major cache layout a run is
one contiguous byte range, so a KV transfer of it is a single UCX message with no staging copy.
"""

from __future__ import annotations

import bisect

from splitserve.errors import CapacityExhausted


class BlockManager:
    """Owns ``num_blocks`` KV blocks, ids ``0 .. num_blocks-1``.

    Invariant: every block id is either in the free list (ref count 0) or has ref count >= 1;
    ``num_free + len(used) == num_blocks`` (see ``check_integrity``).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # sorted ascending
        self._ref_counts: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1), a consecutive run when one exists (first fit).

        Raises:
            CapacityExhausted: fewer than ``n`` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise CapacityExhausted(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        if n == 0:
            return []
        start = self._find_run(n)
        if start is not None:
            taken = self._free[start : start + n]
            del self._free[start : start + n]
        else:
            taken = self._free[:n]
            del self._free[:n]
        for block_id in taken:
            self._ref_counts[block_id] = 1
        return taken

    def _find_run(self, n: int) -> int | None:
        """Index into the free list where ``n`` consecutive block ids start, or None."""
        free = self._free
        run_start = 0
        for i in range(1, len(free) + 1):
            if i - run_start >= n:
                return run_start
            if i < len(free) and free[i] != free[i - 1] + 1:
                run_start = i
        return None

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks (e.g. a cached prefix) with one more owner."""
        for block_id in block_ids:
            if block_id not in self._ref_counts:
                raise ValueError(f"block {block_id} is not allocated")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free list.

        Raises:
            ValueError: a block is not allocated (double free).
        """
        for block_id in block_ids:
            count = self._ref_counts.get(block_id)
            if count is None:
                raise ValueError(f"double free of KV block {block_id}")
            if count == 1:
                del self._ref_counts[block_id]
                bisect.insort(self._free, block_id)
            else:
                self._ref_counts[block_id] = count - 1

    def check_integrity(self) -> None:
        """Raise AssertionError-free ValueError if free + used != total or ids overlap."""
        used = set(self._ref_counts)
        if len(self._free) + len(used) != self.num_blocks or used.intersection(self._free):
            raise ValueError("block manager integrity violated")
