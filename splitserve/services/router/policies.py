"""Routing policies: which worker of a role gets a request. Prefill and decode are picked independently.

* ``round_robin``: next worker in turn (one counter per role).
* ``least_loaded``: power of two choices -- sample two workers, take the less loaded one. Prefill load is
  queued (uncached, in-flight) prompt tokens; decode load is running requests, then fewer free KV blocks.
* ``prefix_aware``: the worker holding the longest matching prefix (by chained block hashes of the
  prompt, :mod:`splitserve.kvstore.block_hash`), unless it is overloaded -- its load exceeds the least
  loaded worker's by more than ``balance_slack`` -- then least_loaded. The router remembers which block
  hashes it sent to each worker (a bounded LRU per worker: an estimate of that worker's prefix cache).
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from typing import Sequence

from splitserve.services.router.prompt_blocks import PromptBlocks
from splitserve.services.router.registry import DECODE, PREFILL, WorkerState

POLICIES = ("round_robin", "least_loaded", "prefix_aware")
Prompt = PromptBlocks | Sequence[int]  # a request's token ids; a PromptBlocks keeps its block hashes between calls


def load_of(w: WorkerState) -> tuple[float, ...]:
    """Sort key: lower is less loaded."""
    if w.role == PREFILL:
        return (float(w.inflight_prefill_tokens), w.running_requests)
    return (w.running_requests, -w.free_blocks)


class Policy:
    name = ""

    def pick(self, role: str, workers: Sequence[WorkerState], prompt: Prompt) -> WorkerState:
        """One of ``workers`` (non-empty, all up) for a request with token ids ``prompt``."""
        raise NotImplementedError

    def matched_tokens(self, w: WorkerState, prompt: Prompt) -> int:
        """Prompt tokens ``w`` is believed to hold in its prefix cache (0 when unknown)."""
        return 0

    def record(self, w: WorkerState, prompt: Prompt) -> None:
        """``w`` has processed ``prompt`` (its KV is now likely cached there)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counters = {PREFILL: itertools.count(), DECODE: itertools.count()}

    def pick(self, role, workers, prompt):
        return workers[next(self._counters[role]) % len(workers)]


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, role, workers, prompt):
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(list(workers), 2)
        la, lb = load_of(a), load_of(b)
        if la == lb:  # already a random pair: either is fine
            return a
        return a if la < lb else b


class PrefixAware(LeastLoaded):
    name = "prefix_aware"

    def __init__(self, block_size: int = 16, capacity_blocks: int = 100_000, balance_slack_tokens: int = 4096,
                 rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.balance_slack_tokens = balance_slack_tokens
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def _hashes(self, prompt: Prompt) -> list[bytes]:
        return PromptBlocks.of(prompt).hashes(self.block_size)

    def _match(self, w: WorkerState, hashes: list[bytes]) -> int:
        held = self._held.get(w.address)
        if not held:
            return 0
        n = 0
        for h in hashes:  # chained: the first miss ends the prefix
            if h not in held:
                break
            n += 1
        return n * self.block_size

    def matched_tokens(self, w, prompt):
        return self._match(w, self._hashes(prompt))

    def pick(self, role, workers, prompt):
        hashes = self._hashes(prompt)
        best, best_match = None, 0
        for w in workers:
            m = self._match(w, hashes)
            if m > best_match:
                best, best_match = w, m
        if best is None:
            return super().pick(role, workers, prompt)
        least = min(workers, key=load_of)
        # balance: a hot prefix must not pile onto one worker. Compare the work each would really do.
        extra = (load_of(best)[0] - load_of(least)[0]) if role == PREFILL else (best.running_requests - least.running_requests) * 256
        if extra - best_match > self.balance_slack_tokens:
            return least
        return best

    def record(self, w, prompt):
        held = self._held.setdefault(w.address, OrderedDict())
        for h in self._hashes(prompt):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)


def make_policy(name: str, block_size: int = 16) -> Policy:
    """Policy by name. Raises ValueError for an unknown name."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        return PrefixAware(block_size=block_size)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
