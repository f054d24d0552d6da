"""KV store settings of a worker (prefill or decode): CLI flags with PD_* environment defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from splitserve.env import env_choice, env_float, env_str

TRANSFER_MODES = ("direct", "store", "push")


@dataclass(frozen=True, slots=True)
class StoreClientConfig:
    """Attributes:

    master: gRPC address of the KV store master; empty = no store (no prefix reuse, direct transfer only).
    transfer_mode: "direct" -- the decode worker pulls the prompt's KV from the prefill worker over UCX;
        "store" -- the prefill worker writes it to the store and the decode worker reads it from there
        (Mooncake style); "push" -- the router dispatches prefill and decode at once and the prefill worker
        writes the KV into the decode worker's blocks layer by layer (the router's setting decides; a prefill
        worker serves pulls as in direct mode). Prefix reuse works in every mode. Otherwise only the prefill
        worker's setting matters: the KV handle tells the decode worker where to read.
    salt: extra namespace of block hashes (e.g. a weights revision; see splitserve.kvstore.block_hash).
    io_timeout_s: deadline of one UCX read/write of object bytes. rpc_timeout_s: of one master call.
    wait_s: how long a decode worker waits for blocks its prefill worker is still writing (store mode).
    """

    master: str = ""
    transfer_mode: str = "direct"
    salt: str = ""
    io_timeout_s: float = 5.0
    rpc_timeout_s: float = 5.0
    wait_s: float = 10.0

    def __post_init__(self) -> None:
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"kv transfer mode must be one of {', '.join(TRANSFER_MODES)}, got {self.transfer_mode!r}")
        if self.transfer_mode == "store" and not self.master:
            raise ValueError("--kv-transfer-mode store needs --kvstore-master")
        if self.io_timeout_s <= 0 or self.rpc_timeout_s <= 0 or self.wait_s <= 0:
            raise ValueError("KV store timeouts must be > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.master)


def add_store_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kvstore-master", default=env_str("PD_KVSTORE_MASTER", ""), help="KV store master host:port (empty: no store)")
    ap.add_argument("--kv-transfer-mode", default=env_choice("PD_KV_TRANSFER_MODE", TRANSFER_MODES, "direct"), choices=TRANSFER_MODES,
                    help="direct: decode pulls KV from prefill over UCX; store: through the KV store; push: prefill writes it into "
                         "decode's blocks layer by layer (set it on the router)")
    ap.add_argument("--kvstore-salt", default=env_str("PD_KVSTORE_SALT", ""),
                    help="extra namespace of block hashes in the store (e.g. a weights revision)")
    ap.add_argument("--kvstore-io-timeout-s", type=float, default=env_float("PD_KVSTORE_IO_TIMEOUT_S", 5.0),
                    help="seconds one UCX read or write of store objects may take")
    ap.add_argument("--kvstore-wait-s", type=float, default=env_float("PD_KVSTORE_WAIT_S", 10.0),
                    help="store mode: seconds a decode worker waits for blocks its prefill worker is still writing")


def store_config(a: argparse.Namespace) -> StoreClientConfig:
    return StoreClientConfig(master=a.kvstore_master, transfer_mode=a.kv_transfer_mode, salt=a.kvstore_salt,
                             io_timeout_s=a.kvstore_io_timeout_s, wait_s=a.kvstore_wait_s)
