"""Space allocation inside one storage segment (plain ints, no I/O).

Best fit over free ranges kept twice: by address (to coalesce neighbours on free) and by (size, start)
(to find the smallest range that fits with one bisect). Sizes are rounded up to ``alignment``.
"""

from __future__ import annotations

import bisect


class SegmentAllocator:
    """Allocates byte ranges of ``[0, capacity)``.

    Invariant: free ranges never overlap or touch (touching ranges are merged), and
    ``free_bytes + used_bytes == capacity`` (see :meth:`check_integrity`).
    """

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if capacity < 1 or alignment < 1:
            raise ValueError(f"capacity and alignment must be >= 1, got {capacity}, {alignment}")
        self.capacity = capacity
        self.alignment = alignment
        self._starts: list[int] = [0]  # free range starts, ascending
        self._size_of: dict[int, int] = {0: capacity}
        self._by_size: list[tuple[int, int]] = [(capacity, 0)]  # (size, start), ascending
        self._allocated: dict[int, int] = {}  # offset -> aligned size
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    def aligned(self, size: int) -> int:
        """Bytes an object of ``size`` bytes occupies."""
        return -(-size // self.alignment) * self.alignment

    def allocate(self, size: int) -> int | None:
        """Offset of a new range of ``size`` bytes, or None if no free range is large enough."""
        if size < 1:
            raise ValueError(f"cannot allocate {size} bytes")
        need = self.aligned(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        free_size, start = self._by_size.pop(i)
        self._remove_start(start)
        if free_size > need:
            self._add_free(start + need, free_size - need)
        self._allocated[start] = need
        self.used_bytes += need
        return start

    def free(self, offset: int) -> None:
        """Return the range allocated at ``offset``. Raises ValueError if nothing is allocated there."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"no allocation at offset {offset}")
        self.used_bytes -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._starts, start)
        if i > 0:  # merge with the free range just before
            prev = self._starts[i - 1]
            if prev + self._size_of[prev] == start:
                self._remove_free(prev)
                start = prev
        nxt_size = self._size_of.get(end)
        if nxt_size is not None:  # merge with the free range just after
            self._remove_free(end)
            end += nxt_size
        self._add_free(start, end - start)

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._size_of[start] = size
        bisect.insort(self._by_size, (size, start))

    def _remove_free(self, start: int) -> None:
        size = self._size_of[start]
        del self._by_size[bisect.bisect_left(self._by_size, (size, start))]
        self._remove_start(start)

    def _remove_start(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._size_of[start]

    def check_integrity(self) -> None:
        """Raise ValueError if the free and allocated ranges do not tile the segment exactly."""
        ranges = sorted([(s, self._size_of[s], "free") for s in self._starts] + [(o, n, "used") for o, n in self._allocated.items()])
        pos = 0
        prev_kind = None
        for start, size, kind in ranges:
            if start != pos or size < 1:
                raise ValueError(f"segment ranges do not tile: {kind} range at {start} (expected {pos})")
            if kind == "free" and prev_kind == "free":
                raise ValueError(f"adjacent free ranges at {start} were not merged")
            pos, prev_kind = start + size, kind
        if pos != self.capacity or sorted(self._by_size) != sorted((n, s) for s, n in self._size_of.items()):
            raise ValueError("segment allocator integrity violated")
        if sum(self._allocated.values()) != self.used_bytes:
            raise ValueError("used_bytes disagrees with the allocations")
