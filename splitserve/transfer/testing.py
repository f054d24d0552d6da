"""Helpers for tests and benchmarks of the KV transfer: a started sender/receiver pair in this process
(:func:`transfer_pair`), and a KV sender in a separate (spawned) process.

``SenderProcess`` starts a child with its own KV pool filled with a known byte pattern (see
:func:`fill_pattern`) and a started sender, and drives it over a pipe: register / unregister transfers,
read the ``on_done`` events and the stats, pause (SIGSTOP), resume, kill. Processes are started with
the ``spawn`` context: never fork after UCX initialisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
from typing import Any, AsyncIterator

import torch

from splitserve.transfer.kv_cache import allocate_kv_cache, byte_view
from splitserve.transfer.layout import KVLayout

# ------------------------------------------------------------------------------------------------ pairs


@contextlib.asynccontextmanager
async def transfer_pair(transport: str, layout: KVLayout, num_blocks: int, salt: int = 0, *, verify_checksum: bool = False,
                        device: str = "cpu", staging: str | None = None,
                        **sender_options: Any) -> AsyncIterator[tuple[Any, Any, torch.Tensor, torch.Tensor]]:
    """A started KV sender over a pool of ``num_blocks`` blocks filled with :func:`fill_pattern` (``salt``) and a
    started receiver over a zeroed pool of as many, both of ``transport``; yields ``(sender, receiver, src, dst)``
    (the pools: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``) and closes both on exit.
    ``sender_options`` go to ``create_sender`` (e.g. ``host``, ``corrupt_sends``). ``device``: where both pools live;
    ``staging``: both sides' staging choice (None: ``PD_KV_TRANSFER_STAGING``)."""
    from splitserve.transfer.base import create_receiver, create_sender

    src = allocate_kv_cache(layout, num_blocks, device)
    fill_pattern(src, salt=salt)
    dst = allocate_kv_cache(layout, num_blocks, device)
    if staging is not None:
        sender_options["staging"] = staging
    sender = create_sender(transport, src, layout, **sender_options)
    receiver = create_receiver(transport, dst, layout, verify_checksum=verify_checksum,
                               **({} if staging is None else {"staging": staging}))
    await sender.start()
    try:
        await receiver.start()
        try:
            yield sender, receiver, src, dst
        finally:
            await receiver.close()
    finally:
        await sender.close()


# ------------------------------------------------------------------------------------------------ patterns


def _base_pattern(block_nbytes: int) -> torch.Tensor:
    return (torch.arange(block_nbytes, dtype=torch.int64) % 251).to(torch.uint8)


def _block_offset(block_id: int, salt: int) -> int:
    return (block_id * 31 + salt * 7 + 1) % 256


def fill_pattern(kv_cache: torch.Tensor, salt: int = 0) -> None:
    """Give every block a distinct, reproducible byte pattern (depends on block id and ``salt``)."""
    flat = byte_view(kv_cache).view(kv_cache.shape[0], -1)
    base = _base_pattern(flat.shape[1]).to(kv_cache.device)
    for b in range(flat.shape[0]):
        torch.add(base, _block_offset(b, salt), out=flat[b])  # uint8 arithmetic wraps mod 256


def expected_block(layout: KVLayout, block_id: int, salt: int = 0) -> torch.Tensor:
    """The bytes :func:`fill_pattern` put into ``block_id``."""
    return _base_pattern(layout.block_nbytes) + _block_offset(block_id, salt)


def block_bytes(kv_cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """Bytes of one block of ``kv_cache`` (a view)."""
    return byte_view(kv_cache).view(kv_cache.shape[0], -1)[block_id]


# ------------------------------------------------------------------------------------------------ process


def _child_main(conn, layout_fields: dict, num_blocks: int, salt: int, env: dict, kind: str, options: dict,
                device: str = "cpu") -> None:
    os.environ.update(env)
    from splitserve.transfer.ucx_runtime import apply_ucx_env_defaults

    apply_ucx_env_defaults()
    asyncio.run(_child_async(conn, KVLayout(**layout_fields), num_blocks, salt, kind, options, device))


async def _child_async(conn, layout: KVLayout, num_blocks: int, salt: int, kind: str, options: dict,
                       device: str = "cpu") -> None:
    from splitserve.transfer import create_sender

    pool = allocate_kv_cache(layout, num_blocks, device)
    fill_pattern(pool, salt)
    sender = create_sender(kind, pool, layout, host="127.0.0.1", port=0, **options)
    await sender.start()
    events: list[tuple[str, bool]] = []
    sources: dict = {}
    loop = asyncio.get_running_loop()
    conn.send(("ready", sender.endpoint))
    try:
        while True:
            try:
                cmd, args = await loop.run_in_executor(None, conn.recv)
            except (EOFError, OSError):
                break
            if cmd == "register":
                tid, blocks = args
                try:
                    sender.register(tid, blocks, lambda t, ok: events.append((t, ok)))
                    conn.send(("ok", None))
                except Exception as exc:  # reported to the parent
                    conn.send(("error", repr(exc)))
            elif cmd == "unregister":
                conn.send(("ok", sender.unregister(args)))
            elif cmd == "events":
                conn.send(("ok", list(events)))
            elif cmd == "stats":
                conn.send(("ok", dataclasses.asdict(sender.stats)))
            elif cmd == "path":  # the sender's KV path ("host", "cuda", "staged")
                conn.send(("ok", sender.path))
            elif cmd == "push_open":  # (bootstrap id, num blocks): a push source, as a prefill worker opens one
                bid, nblocks = args
                sources[bid] = sender.open_push(bid, nblocks)
                conn.send(("ok", None))
            elif cmd == "push_layers":  # (bootstrap id, src block ids, layers done)
                bid, blocks, n = args
                sources[bid].layers_done(blocks, n)
                conn.send(("ok", None))
            elif cmd == "push_finish":  # (bootstrap id, src block ids, first tokens) -> delivered
                bid, blocks, tokens = args
                conn.send(("ok", await sources.pop(bid).finish(tokens, blocks, False, 10.0)))
            elif cmd == "close":
                await sender.close()
                conn.send(("ok", list(events)))
                return
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    finally:
        await sender.close()


class SenderProcess:
    """A KV sender in a spawned child process (``kind`` "ucx" by default) over a pool on ``device``."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        salt: int = 0,
        env: dict[str, str] | None = None,
        kind: str = "ucx",
        options: dict[str, Any] | None = None,
        device: str = "cpu",
    ) -> None:
        self.layout = layout
        self.salt = salt
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main,
            args=(child_conn, dataclasses.asdict(layout), num_blocks, salt, dict(env or {}), kind, dict(options or {}), device),
            daemon=True,
        )
        self.endpoint: str | None = None

    def start(self, timeout_s: float = 60.0) -> str:
        self.proc.start()
        if not self._conn.poll(timeout_s):
            self.kill()
            raise RuntimeError("sender process did not start")
        try:
            tag, endpoint = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"sender process exited during start-up (exit code {self.proc.exitcode})") from None
        if tag != "ready":
            self.kill()
            raise RuntimeError(f"sender process failed to start: {endpoint}")
        self.endpoint = endpoint
        return endpoint

    def _call(self, cmd: str, args: Any = None, timeout_s: float = 30.0) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"sender process did not answer {cmd!r}")
        tag, value = self._conn.recv()
        if tag != "ok":
            raise RuntimeError(value)
        return value

    def register(self, transfer_id: str, block_ids: list[int]) -> None:
        self._call("register", (transfer_id, list(block_ids)))

    def unregister(self, transfer_id: str) -> bool:
        return self._call("unregister", transfer_id)

    def push_open(self, bootstrap_id: str, num_blocks: int) -> None:
        self._call("push_open", (bootstrap_id, num_blocks))

    def push_layers(self, bootstrap_id: str, block_ids: list[int], num_layers: int) -> None:
        self._call("push_layers", (bootstrap_id, list(block_ids), num_layers))

    def push_finish(self, bootstrap_id: str, block_ids: list[int], tokens: list[int]) -> bool:
        return self._call("push_finish", (bootstrap_id, list(block_ids), list(tokens)))

    def events(self) -> list[tuple[str, bool]]:
        return [tuple(e) for e in self._call("events")]

    def stats(self) -> dict[str, int]:
        return self._call("stats")

    def path(self) -> str:
        """The sender's KV path (:mod:`splitserve.transfer.paths`)."""
        return self._call("path")

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the sender cleanly and wait for the process to exit (kill it if it hangs)."""
        if self.proc.is_alive():
            try:
                self._call("close", timeout_s=timeout_s)
            except (TimeoutError, EOFError, OSError, RuntimeError):
                pass
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.kill()
