"""RoutedBackend: the router's GenerationBackend. Disaggregated generation over the worker registry, a routing
policy, conditional disaggregation and failover.

Per request (:meth:`RoutedBackend.generate`):

1. Wait (briefly) for a decode worker to be up; pick one with the policy.
2. Prefill leg (:mod:`.prefill_leg`): pick a prefill worker, decide local or remote prefill from the *uncached*
   prompt tokens, prefill remotely with retries on other prefill workers, else fall back to local prefill.
3. Decode leg (:mod:`.decode_leg`): stream the tokens from the decode worker (with the prefill's KV handle, or
   prefilling locally), retrying on another decode worker until the stream starts, under a stall guard; KV no
   decode worker pulled is released on exit (:mod:`.kv_release`). A stream whose worker dies or stalls after tokens
   flowed continues on another decode worker from the tokens already sent (:mod:`.migration`).

Events: a remote prefill gives one TokenEvent per choice first (``index`` i, choice i's first token and its logprob,
the prompt's logprobs on the very first event), then the decode stream's events (``index``, logprobs); with n > 1
the choices interleave and each ends with its own finish_reason. Every SamplingParams field travels to both workers
(``sampling_to_proto``); client-only fields (stop strings) stay with the front door.

Hung workers: gRPC keepalive fails the calls to a stopped or unreachable worker with UNAVAILABLE
(``splitserve.rpc.keepalive``); a decode stream that sends nothing for ``decode_stall_timeout_s`` fails the same way
(:mod:`.stall`). Either takes the worker out of rotation, before or after the first token.

Clients cannot pick workers: addresses come only from the registry (router configuration).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import WorkerUnavailable
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import sampling_to_proto
from splitserve.services.router.decode_leg import DecodeLeg
from splitserve.services.router.disaggregation import DisaggregationPolicy
from splitserve.services.router.kv_release import KVRelease
from splitserve.services.router.layouts import check_layouts
from splitserve.services.router.policies import Policy, RoundRobin
from splitserve.services.router.prefill_leg import prefill_leg
from splitserve.services.router.prompt_blocks import PromptBlocks
from splitserve.services.router.push_leg import push_leg
from splitserve.services.router.registry import DECODE, PREFILL, WorkerRegistry, WorkerState
from splitserve.telemetry.metrics import ROUTER_WORKER_PICKS


class RoutedBackend:
    """GenerationBackend over a :class:`WorkerRegistry` (see the module docstring).

    Args:
        registry: the workers (its poll loop is started by :meth:`start`).
        policy: routing policy (default round robin).
        disagg: conditional disaggregation (default: always remote).
        prefill_timeout_s: deadline of one Prefill call, in seconds.
        prefill_attempts / decode_attempts: bounded tries on distinct workers of each role.
        wait_for_workers_s: how long a request waits for a worker of a role to be up before failing
            with UNAVAILABLE (covers start-up and a short outage).
        local_prefill_fallback: prefill on the decode worker when no prefill worker is up or succeeded
            (off: such requests fail with UNAVAILABLE).
        decode_stall_timeout_s: a decode stream with no message for this long fails as UNAVAILABLE (None: no limit).
        decode_migrations: times a choice's stream may move to another decode worker after its worker failed
            mid-stream (:mod:`.migration`; 0: off, the request ends with the failure's typed error).
        skip_prefill_tokens: prefill on the decode worker, skipping the prefill worker, when the policy believes the
            decode worker's prefix cache holds all but at most this many prompt tokens (0: never).
        kv_transfer_mode: "push": prefill and decode at once, the prefill worker writes the KV into decode's blocks
            layer by layer (:mod:`.push_leg`); anything else: the decode worker pulls it after the prefill.

    Attributes:
        counters: request, retry, fallback, stall, migration and KV release counts (:meth:`stats`).
        streams_open: requests being generated now.
    """

    def __init__(self, registry: WorkerRegistry, policy: Policy | None = None, disagg: DisaggregationPolicy | None = None,
                 *, prefill_timeout_s: float = 60.0, prefill_attempts: int = 2, decode_attempts: int = 2,
                 wait_for_workers_s: float = 5.0, local_prefill_fallback: bool = True,
                 decode_stall_timeout_s: float | None = 60.0, decode_migrations: int = 1,
                 skip_prefill_tokens: int = 0, kv_transfer_mode: str = "direct") -> None:
        self.registry = registry
        self.policy = policy or RoundRobin()
        self.disagg = disagg or DisaggregationPolicy("always")
        self.prefill_timeout_s = prefill_timeout_s
        self.prefill_attempts, self.decode_attempts = max(prefill_attempts, 1), max(decode_attempts, 1)
        self.wait_for_workers_s = wait_for_workers_s
        self.local_prefill_fallback = local_prefill_fallback
        self.decode_stall_timeout_s = decode_stall_timeout_s
        self.decode_migrations = max(decode_migrations, 0)
        self.skip_prefill_tokens = skip_prefill_tokens
        self.kv_transfer_mode = kv_transfer_mode
        self.counters: Counter[str] = Counter()
        self.streams_open = 0
        self.kv_release = KVRelease(self.counters)
        self._block_size_set = False

    def start(self) -> None:
        self.registry.start()

    async def ready(self) -> bool:
        """Serving is possible: at least one decode worker is up (prefill can fall back to local)."""
        return bool(self.registry.up(DECODE))

    async def check_layouts(self, retry_s: float = 1.0) -> None:
        """Log an error for every prefill/decode pair whose KV layouts differ (:func:`.layouts.check_layouts`)."""
        await check_layouts(self.registry.workers[PREFILL], self.registry.workers[DECODE], retry_s)

    def workers_view(self) -> dict:
        return {"policy": self.policy.name, "disaggregation": self.disagg.describe(), "workers": self.registry.snapshot()}

    def stats(self) -> dict[str, float]:
        return {"streams_open": self.streams_open, "background_tasks": len(self.kv_release.tasks), **self.counters}

    def pick(self, role: str, prompt: PromptBlocks | list[int], exclude: set[str]) -> WorkerState | None:
        """A worker of ``role`` chosen by the policy among those up and not in ``exclude`` (addresses); None if none."""
        candidates = [w for w in self.registry.up(role) if w.address not in exclude]
        if not candidates:
            return None
        w = self.policy.pick(role, candidates, prompt)
        w.picks += 1
        ROUTER_WORKER_PICKS.labels(role, w.address).inc()
        return w

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens. ``deadline``: absolute ``time.monotonic()`` time, or None.

        Raises:
            WorkerUnavailable: no decode worker is up (after ``wait_for_workers_s``), or no prefill worker when
                the request may not be prefilled locally.
            PdError: the typed error of a worker failure that was not moved to another worker.
        """
        self.counters["requests"] += 1
        self.streams_open += 1
        try:
            self._sync_block_size()
            await self._wait_for_workers()
            prompt = PromptBlocks(prompt_token_ids)  # its block hashes are computed once, for every pick and record
            sampling = sampling_to_proto(params)
            decode = self.pick(DECODE, prompt, set())
            pushed = None
            if self.kv_transfer_mode == "push" and params.max_tokens > 1:
                pushed = await push_leg(self, request_id, prompt, sampling, decode, deadline)
            if pushed is not None:
                request_id = pushed.request_id  # another id while a dropped push call drains on the decode worker
            remote = pushed.remote if pushed and pushed.remote else await prefill_leg(self, request_id, prompt, sampling,
                                                                                      decode, deadline)
            if remote is not None and remote.finished:  # prefill alone finished the request: no decode leg, no KV left
                for ev in remote.first_events():
                    yield ev
                return
            leg = DecodeLeg(self, request_id, prompt, sampling, decode, remote, deadline, call=pushed.call if pushed else None)
            async with contextlib.aclosing(leg.events()) as events:
                async for ev in events:
                    yield ev
        finally:
            self.streams_open -= 1

    async def _wait_for_workers(self) -> None:
        if not await self.registry.wait_for(DECODE, self.wait_for_workers_s):
            raise WorkerUnavailable("no decode worker is up")
        if not self.registry.up(PREFILL) and self.disagg.mode == "always":
            await self.registry.wait_for(PREFILL, min(self.wait_for_workers_s, 1.0))

    def _sync_block_size(self) -> None:
        """Give a prefix-aware policy the workers' KV block_size (tokens) once a worker has reported its layout."""
        if self._block_size_set or not hasattr(self.policy, "block_size"):
            return
        for w in self.registry.all():
            if w.layout is not None:
                self.policy.block_size = w.layout.block_size
                self._block_size_set = True
                return

    async def close(self) -> None:
        await self.kv_release.wait()
        await self.registry.close()
