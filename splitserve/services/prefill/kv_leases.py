"""KV held by a prefill worker between its response and the decode worker's pull.

A lease owns its transfer's blocks (an OwnedBlocks handed over by ``hold``) and frees them exactly once:
when the pull completes (or fails), when the decode side releases them (ReleaseKV), or when the lease
expires.
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.telemetry.metrics import KV_LEASES_EXPIRED
from splitserve.transfer.base import KVSender

logger = logging.getLogger(__name__)


class KVLeases:
    def __init__(self, sender: KVSender, lease_s: float) -> None:
        self._sender = sender
        self._lease_s = lease_s
        self._held: dict[str, tuple[OwnedBlocks, asyncio.TimerHandle]] = {}
        self.expired = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, transfer_id: str, blocks: OwnedBlocks, lease_s: float | None = None) -> float:
        """Serve ``blocks`` to one pull under ``transfer_id`` for at most ``lease_s`` seconds (default and upper
        bound: the configured lease; shorter when the caller's deadline ends sooner); consumes ``blocks``.
        Returns the lease granted (s). Raises ValueError (from the sender: a duplicate id) with ``blocks`` left
        to the caller."""
        granted = self._lease_s if lease_s is None else max(0.0, min(lease_s, self._lease_s))
        self._sender.register(transfer_id, blocks.block_ids, self._on_done)
        timer = asyncio.get_running_loop().call_later(granted, self._expire, transfer_id, granted < self._lease_s)
        self._held[transfer_id] = (blocks.move(), timer)
        return granted

    def _on_done(self, transfer_id: str, ok: bool) -> None:
        if not ok:
            logger.warning("KV transfer %s failed; freeing its blocks", transfer_id)
        self._drop(transfer_id)

    def _expire(self, transfer_id: str, cut_by_deadline: bool = False) -> None:
        if self._sender.unregister(transfer_id):
            if cut_by_deadline:  # the caller's deadline passed (e.g. it expired as prefill finished): expected, not a fault
                logger.info("KV lease of transfer %s ended with its caller's deadline; blocks freed", transfer_id)
            else:
                logger.warning("KV lease expired for transfer %s: no decode worker pulled it", transfer_id)
            self.expired += 1
            KV_LEASES_EXPIRED.inc()
            self._drop(transfer_id)

    def release(self, transfer_id: str) -> bool:
        """Free without sending (the decode leg will not come). False if nothing is held.

        Blocks that a pull is reading right now are freed when that pull ends, never earlier."""
        if transfer_id not in self._held:
            return False
        if self._sender.unregister(transfer_id):
            self._drop(transfer_id)
        # else a pull is in flight: its on_done frees the blocks once UCX no longer reads them
        return True

    def _drop(self, transfer_id: str) -> None:
        entry = self._held.pop(transfer_id, None)
        if entry is not None:
            blocks, timer = entry
            timer.cancel()
            blocks.free()

    def release_all(self) -> None:
        for transfer_id in list(self._held):
            self.release(transfer_id)
