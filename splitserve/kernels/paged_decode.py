"""Decode attention read in place from the paged KV cache (``cpu_kernels.cpp``: ``paged_decode_attention``).

The torch path of :mod:`splitserve.model.attention` gathers each decode sequence's context blocks into a copy
(``index_select``), pads the batch to its longest context and runs SDPA with a mask. On the CPU, for float32
queries (a float32 model, or a 16-bit one on the packed kernels) over a float32, bfloat16 or float16 cache, this
kernel reads the K/V rows where they are (block table lookups), computes each sequence's own
context length only, and shares each K/V row among the query heads of its group (GQA). Built and loaded by
:mod:`splitserve.kernels.build`.
"""

from __future__ import annotations

import torch

from splitserve.kernels import build


CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(kv_cache: torch.Tensor, query_dtype: torch.dtype = torch.float32) -> bool:
    """The kernel serves this cache and queries: float32 queries, a float32/bfloat16/float16 cache, contiguous, on the
    CPU, and the kernels are enabled and built."""
    return (kv_cache.device.type == "cpu" and query_dtype == torch.float32 and kv_cache.dtype in CACHE_DTYPES
            and kv_cache.is_contiguous() and build.load() is not None)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor) -> torch.Tensor:
    """``softmax(q K^T / sqrt(D)) V`` of one query token per sequence over its context in ``kv_cache``.

    Args:
        q: float32 ``[B, Hq, D]``, each row's ``[Hq, D]`` contiguous (copied if not; rows may be strided, e.g. the
            q heads of the fused qkv output); query head j attends with KV head ``j // (Hq / Hkv)``.
        kv_cache: ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` float32, bfloat16 or float16, contiguous,
            this step's K/V written (16-bit rows are widened to float32 as they are read).
        layer: which layer's K/V.
        block_tables: int64 ``[B, M]``: each sequence's block ids (entries past its context are not read).
        seq_lens: int64 ``[B]``: context tokens of each sequence (1 .. M * block_size).
    Returns:
        float32 ``[B, Hq, D]``.
    Raises:
        RuntimeError: bad shapes, dtypes, a block id out of range, a length outside its table, or no kernels.
    """
    module = build.required()
    rows_ok = q.stride(-1) == 1 and q.stride(-2) == q.shape[-1]  # a row stride of its own is read as it is
    return module.paged_decode_attention(q if rows_ok else q.contiguous(), kv_cache, layer, block_tables,
                                         seq_lens, q.shape[-1] ** -0.5, 0)  # 0: torch's threads
