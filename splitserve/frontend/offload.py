"""CPU-heavy request preparation off the asyncio event loop.

Parsing a large body, rendering a chat template and tokenizing a long prompt take from
microseconds to seconds of CPU. Run on the event loop they stall every other request (health
checks, streams in flight, their SSE keep-alives). :class:`Offload` runs them in worker threads
instead; the tokenizer wrappers encode with ``tokenizers``' ``encode_batch``, which releases the
GIL, so the loop keeps running while a thread tokenizes (``Tokenizer.encode`` holds the GIL for the
whole call). ``json.loads`` and pydantic hold the GIL, but only in bounded slices (bodies are capped
at 16 MiB) that the interpreter's switch interval interleaves with the loop.

Two lanes, so that a few huge prompts never queue small requests behind them: work for bodies of
at least ``large_bytes`` runs in the ``large`` pool (``large_workers`` threads), all other work in
the ``small`` pool (``small_workers`` threads). Both pools are created lazily and their threads are
named ``splitserve-prep-small-N`` / ``splitserve-prep-large-N``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

DEFAULT_LARGE_BYTES = 256 * 1024
"""Bodies (or prompts) at least this large are prepared in the large lane."""


class Offload:
    """Two thread pools for request preparation (see the module docstring).

    Args:
        small_workers: threads for ordinary requests.
        large_workers: threads for requests of at least ``large_bytes`` bytes.
        large_bytes: the lane threshold, in bytes of body (or prompt).

    Raises:
        ValueError: a worker count below 1 or a negative threshold.
    """

    def __init__(self, small_workers: int = 4, large_workers: int = 2, large_bytes: int = DEFAULT_LARGE_BYTES) -> None:
        if small_workers < 1 or large_workers < 1 or large_bytes < 0:
            raise ValueError("Offload needs >= 1 worker per lane and a threshold >= 0")
        self.large_bytes = large_bytes
        self._small = ThreadPoolExecutor(small_workers, thread_name_prefix="splitserve-prep-small")
        self._large = ThreadPoolExecutor(large_workers, thread_name_prefix="splitserve-prep-large")

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread of the lane for ``size`` bytes; its result or exception.

        Cancelling the awaiting task does not stop a call already running (it finishes and is dropped).
        """
        pool = self._large if size >= self.large_bytes else self._small
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop accepting work; threads exit once their current call returns."""
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)
