"""Store keys of KV blocks: a chained hash over full blocks, namespaced by model and KV layout.

Definition (version 1; every process computes the same keys -- nothing depends on PYTHONHASHSEED, the
process or the machine)::

    root   = xxh3_128(b"splitserve/kv-block/v1\\0" + namespace)             # seed 0
    h[i]   = xxh3_128(h[i-1] || token_ids[i*B : (i+1)*B] as uint32 LE)      # seed 0, h[-1] = root
    key[i] = h[i] as 32 lowercase hex digits

* ``B`` is the layout's ``block_size``; only *full* blocks get a key (a partial last block has none).
* ``namespace`` is ``KVLayout.describe()`` -- model id (name + digest of its config), layers, KV heads,
  head_dim, block_size, dtype -- plus an optional operator-given ``salt`` (e.g. a weights revision,
  because two checkpoints with the same name and config share a model id). Different models, dtypes or
  block sizes therefore never share keys.
* Because each hash covers its parent, ``key[i]`` names the whole prefix ``token_ids[: (i+1)*B]``; equal
  keys mean equal prefixes up to a 128-bit collision (about n^2 / 2^129 for n stored blocks).
"""

from __future__ import annotations

import struct
from typing import Sequence

import xxhash

from splitserve.transfer.layout import KVLayout

VERSION_TAG = b"splitserve/kv-block/v1\x00"
SEED = 0


def namespace_root(layout: KVLayout, salt: str = "") -> bytes:
    """The 16-byte root hash of a namespace (the parent of block 0)."""
    ns = layout.describe().encode() + b"\x00" + salt.encode()
    return xxhash.xxh3_128_digest(VERSION_TAG + ns, seed=SEED)


def chain_hashes(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """16-byte hashes of every full block of ``token_ids`` under ``root``."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    raw = struct.pack(f"<{n * block_size}I", *token_ids[: n * block_size])  # no numpy: the router hashes too
    step = 4 * block_size
    out, parent = [], root
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + raw[i * step : (i + 1) * step], seed=SEED)
        out.append(parent)
    return out


class BlockHasher:
    """Keys of prompt blocks for one KV layout (cheap to keep: the root is computed once)."""

    def __init__(self, layout: KVLayout, salt: str = "") -> None:
        self.block_size = layout.block_size
        self.root = namespace_root(layout, salt)

    def keys(self, token_ids: Sequence[int]) -> list[str]:
        """Store keys of the full blocks of ``token_ids``, in order."""
        return [h.hex() for h in chain_hashes(self.root, token_ids, self.block_size)]
