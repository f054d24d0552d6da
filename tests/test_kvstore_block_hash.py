"""Block hashes: deterministic across processes, chained, full blocks only, namespaced by layout."""

import os
import subprocess
import sys

import numpy as np
import xxhash

from splitserve.kvstore.block_hash import BlockHasher
from splitserve.transfer.layout import KVLayout

LAYOUT = KVLayout("TinyStories-656K-1910fae1fc43", 2, 4, 16, 16, "float32")


def test_keys_are_chained_over_full_blocks_only():
    h = BlockHasher(LAYOUT)
    tokens = list(range(100, 150))  # 3 full blocks + 2 tokens
    keys = h.keys(tokens)
    assert len(keys) == 3 and all(len(k) == 32 for k in keys) and len(set(keys)) == 3
    assert h.keys(tokens[:48]) == keys  # the partial tail has no key
    assert h.keys(tokens[:15]) == []
    other = tokens.copy()
    other[3] = 7  # changes block 0, hence every later key (chained)
    assert all(a != b for a, b in zip(h.keys(other), keys))
    same_start = tokens[:32] + [1] * 16
    assert h.keys(same_start)[:2] == keys[:2] and h.keys(same_start)[2] != keys[2]


def test_namespace_separates_models_dtypes_block_sizes_and_salts():
    tokens = list(range(64))
    base = BlockHasher(LAYOUT).keys(tokens)[0]
    variants = [
        KVLayout("other-model", 2, 4, 16, 16, "float32"),
        KVLayout(LAYOUT.model_id, 2, 4, 16, 16, "bfloat16"),
        KVLayout(LAYOUT.model_id, 2, 4, 16, 32, "float32"),
    ]
    keys = {BlockHasher(v).keys(tokens)[0] for v in variants} | {BlockHasher(LAYOUT, salt="rev2").keys(tokens)[0]}
    assert base not in keys and len(keys) == 4


def test_same_keys_in_another_process_with_another_hash_seed():
    tokens = list(range(1000, 1040))
    code = ("from splitserve.kvstore.block_hash import BlockHasher; from splitserve.transfer.layout import KVLayout; "
            f"print(','.join(BlockHasher(KVLayout({LAYOUT.model_id!r}, 2, 4, 16, 16, 'float32')).keys({tokens!r})))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "12345"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out.split(",") == BlockHasher(LAYOUT).keys(tokens)


def test_matches_the_documented_definition():
    """xxh3_128 with seed 0 over (parent || uint32 LE token ids); root from the v1 tag and the layout."""
    root = xxhash.xxh3_128_digest(b"splitserve/kv-block/v1\x00" + LAYOUT.describe().encode() + b"\x00", seed=0)
    expect = xxhash.xxh3_128_digest(root + np.arange(16, dtype="<u4").tobytes(), seed=0).hex()
    assert BlockHasher(LAYOUT).keys(list(range(16)))[0] == expect
