"""Stop strings over a stream of text deltas (OpenAI semantics).

Text is held back while the tail of the output could still become a stop string, so a
partial match is never streamed out. On a full match the output is cut just before the
stop string (the stop string itself is not returned) and the checker reports it; the
caller then ends generation. Matches may span any number of deltas (tokens).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Incremental stop-string matcher.

    Args:
        stops: the stop strings (non-empty strings; an empty sequence disables stopping).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add generated text; return what can be safely emitted now.

        After a full match ``stopped`` is True, ``matched`` names the stop string, and the
        returned text ends right before it; further input is ignored.
        """
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hit = self._earliest_match(buf)
        if hit is not None:
            pos, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[:pos]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """Return the held-back text once generation has ended without a match."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
