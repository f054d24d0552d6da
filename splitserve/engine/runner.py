"""Model runner: turns scheduled sequences into tensors (slot_mapping, block tables), runs the model, samples."""

from __future__ import annotations

import torch

from splitserve.engine.sampler import sample
from splitserve.engine.sequence import Sequence
from splitserve.model import AttentionMetadata, LoadedModel


class ModelRunner:
    """Owns the KV cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of one worker.

    Threads per phase: a step whose sequences all feed one token (decode) runs with ``decode_threads``
    torch threads, any other step with the thread count set when the runner was built (``--torch-threads``).
    ``decode_threads`` 0 means the same for both.
    """

    def __init__(self, lm: LoadedModel, kv_cache: torch.Tensor, block_size: int, decode_threads: int = 0) -> None:
        self.lm = lm
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.prefill_threads = torch.get_num_threads()
        self.decode_threads = min(decode_threads, self.prefill_threads) or self.prefill_threads

    def execute(self, seqs: list[Sequence]) -> list[int]:
        """One forward over ``seqs`` (each feeds ``num_step_tokens`` tokens from ``num_computed_tokens``);
        returns one sampled token per sequence (meaningless for a partial prefill chunk)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for seq in seqs:
            start = seq.num_computed_tokens
            end = start + seq.num_step_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(end - start)
            seq_lens.append(end)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=[seq.block_table for seq in seqs],
            block_size=bs,
        )
        threads = self.decode_threads if len(input_ids) == len(seqs) else self.prefill_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        with torch.inference_mode():
            logits = self.lm.model(
                torch.tensor(input_ids, dtype=torch.long),
                torch.tensor(positions, dtype=torch.long),
                self.kv_cache,
                attn,
            )
        return sample(logits, [s.params for s in seqs], [len(s.output_token_ids) for s in seqs])
