"""CUDA graphs for decode steps: one graph per (batch bucket, KV-blocks bucket), captured on first use, replayed.

A small decode batch on a GPU is bound by kernel launches, not by memory: replaying a captured step launches
the whole forward at once. A step of ``n`` sequences whose longest context spans ``k`` KV blocks runs in the
graph of the smallest batch bucket >= n and blocks bucket >= k (powers of two up to ``max_num_seqs`` and up to
the blocks of ``min(max_model_len, MAX_GRAPH_CONTEXT)``, each list ending with its limit); a step with a longer
context runs eagerly (a graph gathers its whole bucket's blocks for every row). The padding rows write their K/V into one
scratch KV block that the block manager never hands out, and attend to it alone; their logits are dropped.

Per step, the inputs (token ids, positions, slot_mapping, context lengths, block tables) are written into one
pinned host buffer and copied to the device in one transfer; the sampled token ids come back in one transfer
(the sampler's). ``--enforce-eager`` turns this off; the engine never builds it on cpu. Only
:class:`CudaGraphDecoder` touches CUDA, and only when constructed on a CUDA cache, so importing this module
without a GPU is harmless. Built over a cpu cache (tests) it runs the same padded fixed-shape steps eagerly:
same buffers and bucket logic, no pinning, no capture.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from splitserve.model.llama import CausalLM

#: longest context (tokens) a captured decode step covers; vLLM's default ``max_seq_len_to_capture``
MAX_GRAPH_CONTEXT = 8192


def graphs_enabled(device: str, enforce_eager: bool) -> bool:
    """Whether an engine on ``device`` replays decode steps as CUDA graphs: on cuda unless ``enforce_eager``."""
    return device.startswith("cuda") and not enforce_eager


def graph_buckets(limit: int) -> tuple[int, ...]:
    """Bucket sizes for values 1..``limit``: the powers of two below ``limit``, then ``limit`` itself
    (``graph_buckets(48)`` = (1, 2, 4, 8, 16, 32, 48)).

    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"graph bucket limit must be >= 1, got {limit}")
    sizes = []
    size = 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return (*sizes, limit)


def bucket_for(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``value`` (``value`` >= 1), or None when ``value`` exceeds the largest."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


class CudaGraphDecoder:
    """Captures and replays fixed-shape decode steps of ``model`` over ``kv_cache`` (both on one CUDA device).

    Args:
        model: the CausalLM (its ``forward_decode_static`` is what a graph captures).
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` on the GPU.
        block_size: tokens per KV block.
        max_num_seqs: the largest batch (the last batch bucket).
        max_model_len: the longest context in tokens (the last blocks bucket covers it, up to MAX_GRAPH_CONTEXT).
        scratch_block: a KV block id no sequence ever owns (padding rows write there).
    """

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, max_num_seqs: int,
                 max_model_len: int, scratch_block: int) -> None:
        import torch

        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.device = kv_cache.device
        self.batch_buckets = graph_buckets(max_num_seqs)
        self.block_buckets = graph_buckets(-(-min(max_model_len, MAX_GRAPH_CONTEXT) // block_size))
        self.max_position = max_model_len
        self.scratch_block = scratch_block
        self._rows, self._cols = self.batch_buckets[-1], self.block_buckets[-1]
        self.cuda = self.device.type == "cuda"
        size = 4 * self._rows + self._rows * self._cols  # ids, positions, slots, context lens, block tables
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=self.cuda)
        self._np = self._host.numpy()
        self._dev = torch.zeros(size, dtype=torch.long, device=self.device) if self.cuda else self._host
        self._copied = self._pool = None
        if self.cuda:
            with torch.cuda.device(self.device):
                self._copied = torch.cuda.Event()
                self._copied.record()
                self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # the RoPE table grows outside any capture (a capture must not allocate tensors that outlive it)
        model.rotary.cos_sin(torch.zeros(1, dtype=torch.long, device=self.device), max_model_len,
                             model.lm_head.weight.dtype)

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def bucket(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """(batch bucket, blocks bucket) of a decode step, or None when it is larger than every bucket."""
        b = bucket_for(num_seqs, self.batch_buckets)
        m = bucket_for(-(-max_seq_len // self.block_size), self.block_buckets)
        return None if b is None or m is None else (b, m)

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            block_tables: list[list[int]], seq_lens: list[int]) -> torch.Tensor:
        """One decode step of ``n`` sequences (one new token each; ``bucket`` must not be None): float32
        ``[n, vocab_size]`` logits, a view valid until the next ``run``."""
        import torch

        key = self.bucket(len(input_ids), max(seq_lens))
        if not self.cuda:
            self._fill(key[0], key[1], input_ids, positions, slot_mapping, block_tables, seq_lens)
            with torch.inference_mode():
                return self._step(*key)[: len(input_ids)]
        with torch.cuda.device(self.device):
            entry = self._graphs.get(key) or self._capture(*key)
            self._fill(key[0], key[1], input_ids, positions, slot_mapping, block_tables, seq_lens)
            entry[0].replay()
        return entry[1][: len(input_ids)]

    def _views(self, b: int, m: int) -> tuple[torch.Tensor, ...]:
        r, d = self._rows, self._dev
        tables = d[4 * r :].view(r, self._cols)[:b, :m]
        return d[:b], d[r : r + b], d[2 * r : 2 * r + b], d[3 * r : 3 * r + b], tables

    def _fill(self, b: int, m: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
              block_tables: list[list[int]], seq_lens: list[int]) -> None:
        """Write the step's inputs (rows ``n..b`` padding) into the pinned buffer; one copy to the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        a, r, n, bs = self._np, self._rows, len(input_ids), self.block_size
        for base, values, pad in ((0, input_ids, 0), (r, positions, 0), (2 * r, slot_mapping, self.scratch_block * bs),
                                  (3 * r, seq_lens, 1)):
            a[base : base + n] = values
            a[base + n : base + b] = pad
        tables = a[4 * r :].reshape(r, self._cols)
        tables[:b, :m] = self.scratch_block
        for i, (table, seq_len) in enumerate(zip(block_tables, seq_lens)):
            used = -(-seq_len // bs)
            tables[i, :used] = table[:used]
        if self.cuda:
            end = 4 * r + b * self._cols
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
            self._copied.record()

    def _step(self, b: int, m: int) -> torch.Tensor:
        """The fixed-shape forward over the device buffers: float32 ``[b, vocab_size]`` logits."""
        from splitserve.model.attention_static import static_decode_plan

        ids, pos, slots, lens, tables = self._views(b, m)
        plan = static_decode_plan(slots, tables, lens, self.block_size)
        return self.model.forward_decode_static(ids, pos, self.kv_cache, plan, self.max_position)

    def _capture(self, b: int, m: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        import torch

        self._fill(b, m, [], [], [], [], [])  # every row padding: warm-up and capture touch the scratch block only
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            self._step(b, m)  # warm-up outside the capture (cuBLAS workspaces, allocator)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._step(b, m)
        self._graphs[(b, m)] = (graph, out)
        return graph, out
