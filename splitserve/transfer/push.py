"""KV push: the prefill worker writes a prompt's KV into blocks the decode worker reserved, layer group by layer
group while the prompt is computed (backend-independent part; the bytes move in ``ucx_push`` / ``inproc``).

Lifecycle of one push (one *bootstrap id*, chosen at random by the router and sent to both workers):

1. Decode reserves ``num_blocks`` KV blocks and *subscribes* on the prefill worker's KV sender: (bootstrap id,
   its destination block ids, ``layer_groups``). Prefill *opens* a :class:`PushSource` under the same id when its
   Prefill call arrives. Either may come first: :class:`PushTable` pairs them; a subscription waits at most
   ``wait_s`` for its source (then it is failed), and a source's ``finish`` waits at most ``wait_s`` for its
   subscription (then it reports False: the caller holds the KV for a pull instead).
2. Layer group ``j`` covers layers ``[j * L // G, (j + 1) * L // G)`` of every block. Once the engine reports
   (``layers_done``, any thread) that the prompt's layers up to a group's end are in the source blocks, that
   group is sent: one message per block (``kv[block, l0:l1]`` is contiguous in the block-major cache).
3. ``finish(first_token_ids)`` sends what is left, then the completion (first token of every choice; with
   ``finished`` no KV: the request ended at prefill), and waits until UCX no longer reads the source blocks.
   ``fail(reason)`` instead completes every unsent data message empty and sends a failure, so the decode side
   frees its blocks at once; a failure before the subscription leaves a tombstone that fails it on arrival. A
   failure says whether the prefill was cancelled (``Status.CANCELLED``: its caller went away, a normal end that
   the decode side does not log as a fault) or failed (``Status.FAILED``).

Invariant: the source blocks must not be written or freed until ``finish``/``fail`` returned.

Device memory: ``layers_done`` (engine thread) takes a *fence* from :attr:`PushTable.fence` -- for a CUDA KV cache
a CUDA event recorded on the engine thread's current stream (:meth:`splitserve.transfer.kv_memory.KVMemory.fence`)
-- and the sender waits on it before it sends those layers, so a group never leaves before the kernels that wrote
it finished.

Telemetry: one ``kv.send`` span per push (a child of the decode side's ``kv.receive`` span through the trace context
of the subscription; bytes, duration, outcome, the ``splitserve:kv_transfer_*`` metrics), with one
``kv.push.layers`` child span per layer group sent (its layer range, blocks and bytes; an error if sending failed).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

from splitserve.telemetry.transfer import observe_push_layers, start_send
from splitserve.transfer.common import Status

logger = logging.getLogger("splitserve.transfer")

MAX_CHOICES = 512  # first tokens one completion message carries


def group_bounds(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """Layer ranges ``[(l0, l1)]`` of ``groups`` layer groups (0 or more than ``num_layers``: one per layer)."""
    g = num_layers if groups <= 0 or groups > num_layers else groups
    return [(j * num_layers // g, (j + 1) * num_layers // g) for j in range(g)]


@dataclass(frozen=True, slots=True)
class PushResult:
    """What a completed push delivered to the decode side."""

    first_token_ids: tuple[int, ...]  # choice i's first token at index i
    finished: bool  # the request ended at prefill: the blocks hold nothing useful
    nbytes: int  # KV bytes written into the destination blocks


class Subscriber(ABC):
    """The decode side of one push as the sender sees it (backend specific). Runs on the sender's event loop."""

    num_blocks: int
    groups: list[tuple[int, int]]

    def alive(self) -> bool:
        """False once the decode side's connection is known to be broken."""
        return True

    @abstractmethod
    def send_group(self, j: int, src_block_ids: list[int]) -> int:
        """Post layer group ``j`` of ``src_block_ids[i]`` -> destination block i for all i; returns bytes posted."""

    @abstractmethod
    def complete(self, first_token_ids: list[int], finished: bool, src_block_ids: list[int] | None) -> None:
        """Post the completion (every group sent before, or ``finished``: empty data messages for the rest)."""

    @abstractmethod
    def fail(self, detail: str, status: Status = Status.FAILED) -> None:
        """Post empty messages for every unsent group and a failure carrying ``status`` and ``detail``
        (FAILED, CANCELLED, CLOSING or LAYOUT_MISMATCH)."""

    @abstractmethod
    async def settle(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until nothing posted reads the source blocks; True if all was delivered."""


class PushSource:
    """The prefill side of one push (see the module docstring). Created by :meth:`PushTable.open`."""

    def __init__(self, table: PushTable, bootstrap_id: str, num_blocks: int, num_layers: int, wait_s: float) -> None:
        self._table = table
        self.bootstrap_id = bootstrap_id
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.wait_s = wait_s
        self._loop = asyncio.get_running_loop()
        self._sub: Subscriber | None = None
        self._attached = asyncio.Event()
        self._src: list[int] | None = None
        self._layers_ready = 0
        self._fence = None  # the latest layers_done's fence (a CUDA event), waited on before sending
        self._send_failed = False  # a group could not be sent: nothing more is sent
        self._sent = 0  # groups sent, in order
        self._obs = None  # the kv.send span, from the subscription on
        self.nbytes = 0
        self.closed = False

    def layers_done(self, src_block_ids: list[int], num_layers: int) -> None:
        """The prompt's K/V of layers ``[0, num_layers)`` is in ``src_block_ids`` (thread-safe; the engine
        thread calls it after each layer of the step that completes the prompt)."""
        fence = self._table.fence() if self._table.fence is not None else None
        self._loop.call_soon_threadsafe(self._progress, list(src_block_ids[: self.num_blocks]), num_layers, fence)

    def _progress(self, src: list[int], num_layers: int, fence=None) -> None:
        if self.closed or self._send_failed:
            return
        if fence is not None:
            self._fence = fence
        self._src = src
        self._layers_ready = max(self._layers_ready, num_layers)
        self._pump()

    def _attach(self, sub: Subscriber) -> None:
        self._sub = sub
        self._obs = start_send(self._table.transport, self.bootstrap_id, self.num_blocks, getattr(sub, "trace_context", ""),
                               path=self._table.path)
        self._attached.set()
        self._pump()

    def _pump(self) -> None:
        sub, src = self._sub, self._src
        if sub is None or src is None or self.closed:
            return
        try:
            if not sub.alive():
                raise ConnectionError("the decode side's connection is broken")
            if self._fence is not None and self._sent < len(sub.groups) and sub.groups[self._sent][1] <= self._layers_ready:
                self._fence.synchronize()  # the engine's kernels that wrote these layers are done
                self._fence = None
            while self._sent < len(sub.groups) and sub.groups[self._sent][1] <= self._layers_ready:
                l0, l1 = sub.groups[self._sent]
                with observe_push_layers(self._obs, self.bootstrap_id, l0, l1, len(src)) as group:
                    group.nbytes = sub.send_group(self._sent, src)
                self.nbytes += group.nbytes
                self._sent += 1
        except Exception as exc:  # the decode side's endpoint failed: finish reports it (settle is False)
            logger.warning("KV push %s: sending failed: %r", self.bootstrap_id, exc)
            self._send_failed = True

    async def _subscriber(self) -> Subscriber | None:
        if self._sub is None:
            try:
                await asyncio.wait_for(self._attached.wait(), self.wait_s)
            except asyncio.TimeoutError:
                return None
        return self._sub

    async def finish(self, first_token_ids: list[int], src_block_ids: list[int] | None, finished: bool,
                     timeout_s: float) -> bool:
        """Send the rest and the completion; True once the decode side has it all. False: no subscription within
        ``wait_s``, or sending failed (then the caller still owns intact source blocks). ``src_block_ids``: the
        prompt's blocks (None with ``finished``)."""
        try:
            sub = await self._subscriber()
            if sub is None:
                self._table.tombstone(self.bootstrap_id, "the prefill finished before the decode worker subscribed")
                return False
            if not finished:
                self._progress(list(src_block_ids[: self.num_blocks]), self.num_layers)
            ok = not self._send_failed and sub.alive()
            try:
                if ok:
                    sub.complete(list(first_token_ids), finished, None if finished else self._src)
                else:
                    sub.fail("sending failed")
            except Exception as exc:  # the connection broke meanwhile
                logger.warning("KV push %s: completing failed: %r", self.bootstrap_id, exc)
                ok = False
            ok = await sub.settle(timeout_s if ok else 0.0) and ok
            self._obs.finish(ok, self.nbytes, None if ok else "push failed")
            return ok
        finally:
            self._close()

    async def fail(self, detail: str, timeout_s: float = 1.0, cancelled: bool = False) -> None:
        """The prefill failed (``cancelled``: its caller cancelled it): tell the decode side (now, or when it
        subscribes) and stop sending."""
        status = Status.CANCELLED if cancelled else Status.FAILED
        try:
            if self._sub is None:
                self._table.tombstone(self.bootstrap_id, detail, status)
                return
            try:
                self._sub.fail(detail, status)
            except Exception as exc:
                logger.info("KV push %s: could not send the failure: %r", self.bootstrap_id, exc)
            await self._sub.settle(timeout_s)
            self._obs.finish(False, self.nbytes, detail)
        finally:
            self._close()

    def _close(self) -> None:
        self.closed = True
        self._table.close(self.bootstrap_id, self)


class PushTable:
    """Pairs subscriptions and sources by bootstrap id (one sender; runs on its event loop).

    Args:
        num_layers: layers of the KV layout. transport: the backend's name (telemetry labels).
        path: the sender's KV path (telemetry label; set by the sender when it starts). fence: called by
            ``layers_done`` on the engine thread; returns an object whose ``synchronize()`` waits for the KV written
            so far (a CUDA event), or None (set by the sender for a CUDA cache).
        wait_s: how long a subscription waits for its source, and a failure is remembered for a late subscription.
    """

    def __init__(self, num_layers: int, wait_s: float = 10.0, transport: str = "ucx") -> None:
        self.num_layers = num_layers
        self.transport = transport
        self.path = "host"
        self.fence = None
        self.wait_s = wait_s
        self._sources: dict[str, PushSource] = {}
        self._waiting: dict[str, tuple[Subscriber, asyncio.TimerHandle]] = {}
        self._tombstones: dict[str, tuple[str, Status, asyncio.TimerHandle]] = {}
        self._settling: set[asyncio.Task] = set()
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sources) + len(self._waiting)

    def open(self, bootstrap_id: str, num_blocks: int, wait_s: float | None = None) -> PushSource:
        """The source of a push of ``num_blocks`` blocks. Raises ValueError on an empty or duplicate id."""
        if not bootstrap_id or bootstrap_id in self._sources:
            raise ValueError(f"bad or duplicate push bootstrap id {bootstrap_id!r}")
        src = PushSource(self, bootstrap_id, num_blocks, self.num_layers, self.wait_s if wait_s is None else wait_s)
        self._sources[bootstrap_id] = src
        waiting = self._waiting.pop(bootstrap_id, None)
        if waiting is not None:
            waiting[1].cancel()
            self._pair(src, waiting[0])
        return src

    def reject(self, sub: Subscriber, detail: str, *args) -> None:
        """Fail ``sub`` now (``args``: backend extras, e.g. a status) and keep it until its messages are delivered
        (UCX cancels the requests of a message object that is garbage collected)."""
        try:
            sub.fail(detail, *args)
        except Exception as exc:  # the connection is gone: nothing to tell
            logger.info("push subscription: could not send its failure: %r", exc)
            return
        task = asyncio.get_running_loop().create_task(sub.settle(self.wait_s))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def subscribe(self, bootstrap_id: str, sub: Subscriber) -> None:
        """A decode worker's subscription arrived (pairs it, or waits ``wait_s`` for its source)."""
        stone = self._tombstones.pop(bootstrap_id, None)
        if stone is not None:
            stone[2].cancel()
            self.reject(sub, stone[0], stone[1])
            return
        src = self._sources.get(bootstrap_id)
        if src is not None:
            self._pair(src, sub)
            return
        if bootstrap_id in self._waiting:
            self.reject(sub, "duplicate subscription")
            return
        timer = asyncio.get_running_loop().call_later(self.wait_s, self._expire, bootstrap_id)
        self._waiting[bootstrap_id] = (sub, timer)

    def _pair(self, src: PushSource, sub: Subscriber) -> None:
        if src._sub is not None:
            self.reject(sub, "duplicate subscription")
        elif sub.num_blocks != src.num_blocks:
            self.reject(sub, f"subscription of {sub.num_blocks} blocks; the prompt has {src.num_blocks}")
        else:
            src._attach(sub)

    def _expire(self, bootstrap_id: str) -> None:
        entry = self._waiting.pop(bootstrap_id, None)
        if entry is not None:
            self.expired += 1
            self.reject(entry[0], f"no prefill request under push id {bootstrap_id!r} within {self.wait_s:g} s")

    def tombstone(self, bootstrap_id: str, detail: str, status: Status = Status.FAILED) -> None:
        """Fail a subscription under ``bootstrap_id`` arriving within ``wait_s`` (or waiting now) with ``status``
        and ``detail``."""
        waiting = self._waiting.pop(bootstrap_id, None)
        if waiting is not None:
            waiting[1].cancel()
            self.reject(waiting[0], detail, status)
            return
        old = self._tombstones.pop(bootstrap_id, None)
        if old is not None:
            old[2].cancel()
        timer = asyncio.get_running_loop().call_later(self.wait_s, self._tombstones.pop, bootstrap_id, None)
        self._tombstones[bootstrap_id] = (detail, status, timer)

    def close(self, bootstrap_id: str, src: PushSource) -> None:
        if self._sources.get(bootstrap_id) is src:
            del self._sources[bootstrap_id]

    def fail_all(self, detail: str) -> None:
        """Fail every waiting subscription (the sender closes)."""
        for bid in list(self._waiting):
            sub, timer = self._waiting.pop(bid)
            timer.cancel()
            self.reject(sub, detail)
