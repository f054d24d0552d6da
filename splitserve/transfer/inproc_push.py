"""KV push for the in-process backend (unit tests): the subscriber copies tensor slices straight into the
receiver's pool (through the two sides' :class:`~splitserve.transfer.kv_memory.KVMemory`: host or CUDA memory,
staged when forced); the completion resolves a future the receiver awaits. Same pairing and errors as UCX."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from splitserve.errors import KVChecksumMismatch, KVLayoutMismatch, KVTransferCancelled, KVTransferError
from splitserve.transfer.common import Status
from splitserve.transfer.kv_memory import KVMemory, checksum
from splitserve.transfer.push import PushResult, Subscriber, group_bounds


def _as_tensor(buf) -> torch.Tensor:
    return torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf


def _blocks_checksum(mem: KVMemory, block_ids: list[int]) -> int:
    """xxh3-64 over whole blocks in order (as the UCX push computes it)."""
    return checksum([mem.host_blocks(b, 1) for b in block_ids])


class InprocSubscriber(Subscriber):
    """Writes into ``dst_pool`` blocks ``dst_block_ids``; ``gone`` once the receiver stopped waiting
    (then any further send fails, as on a dead connection)."""

    def __init__(self, src_pool: KVMemory, dst_pool: KVMemory, block_nbytes: int, num_layers: int,
                 dst_block_ids: list[int], layer_groups: int, verify: bool) -> None:
        self._src, self._dst = src_pool, dst_pool
        self._bn, self._ln = block_nbytes, block_nbytes // num_layers
        self._dst_ids = list(dst_block_ids)
        self._verify = verify
        self.num_blocks = len(dst_block_ids)
        self.groups = group_bounds(num_layers, layer_groups)
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.gone = False
        self.nbytes = 0

    def _live(self) -> None:
        if self.gone:
            raise KVTransferError("the push subscriber is gone")

    def send_group(self, j: int, src_block_ids: list[int]) -> int:
        self._live()
        (l0, l1), bn, ln = self.groups[j], self._bn, self._ln
        self._src.ready()
        for s, d in zip(src_block_ids, self._dst_ids):
            sent = self._src.send_range(s * bn + l0 * ln, (l1 - l0) * ln)
            buf = self._dst.recv_range(d * bn + l0 * ln, (l1 - l0) * ln)
            _as_tensor(buf).copy_(_as_tensor(sent))
            self._dst.land(d * bn + l0 * ln, buf)
        n = len(src_block_ids) * (l1 - l0) * ln
        self.nbytes += n
        return n

    def complete(self, first_token_ids: list[int], finished: bool, src_block_ids: list[int] | None) -> None:
        self._live()
        checksum = None
        if self._verify and not finished:
            checksum = _blocks_checksum(self._src, src_block_ids)
        if not self.future.done():
            self.future.set_result((PushResult(tuple(first_token_ids), finished, 0 if finished else self.nbytes), checksum))

    def fail(self, detail: str, status: Status = Status.FAILED) -> None:
        if not self.future.done():
            if status is Status.LAYOUT_MISMATCH:
                exc = KVLayoutMismatch(detail)
            elif status is Status.CANCELLED:
                exc = KVTransferCancelled(f"KV push cancelled: {detail}")
            else:
                exc = KVTransferError(f"KV push failed: {detail}")
            self.future.set_exception(exc)

    async def settle(self, timeout_s: float) -> bool:
        return not self.gone


async def receive_push(sender, rx, endpoint: str, bootstrap_id: str, dst_block_ids: list[int], layer_groups: int,
                       timeout_s: float) -> PushResult:
    """The inproc receiver's :meth:`receive_push` against ``sender`` (an InprocKVSender)."""
    sub = InprocSubscriber(sender._mem, rx._mem, rx._block_nbytes, sender._layout.num_layers, dst_block_ids,
                           layer_groups, rx._verify)
    if sender._block_nbytes != rx._block_nbytes or sender._digest != rx._digest:
        sub.fail(f"KV layout mismatch with sender {endpoint}: remote [{sender._layout.describe()}]", Status.LAYOUT_MISMATCH)
    else:
        sender.push_table.subscribe(bootstrap_id, sub)
    try:
        result, checksum = await asyncio.wait_for(asyncio.shield(sub.future), timeout_s)
    except asyncio.TimeoutError:
        raise KVTransferError(f"KV push {bootstrap_id!r} from {endpoint} timed out") from None
    finally:
        sub.gone = True  # from here on the caller may free the blocks: no more copies into them
        if not sub.future.done():
            sub.future.cancel()
    if checksum is not None:
        got = _blocks_checksum(rx._mem, dst_block_ids)
        if got != checksum:
            rx.stats.checksum_failures += 1
            raise KVChecksumMismatch(f"KV push {bootstrap_id!r} from {endpoint} is corrupted")
    return result
