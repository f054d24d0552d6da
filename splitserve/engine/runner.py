"""Model runner: turns scheduled sequences into tensors (slot_mapping, block tables), runs the model, samples."""

from __future__ import annotations

import torch

from splitserve.engine.sampler import SampleRow, sample
from splitserve.engine.sequence import Sequence
from splitserve.model import AttentionMetadata, LoadedModel


# Measured with synthetic:llama-25m fp32 on the 2-core AVX2 machine, 1 vs 2 threads (tokens/s): decode of 1
# sequence 70-86 vs 7-36, of 4: 143-152 vs 15-27, of 8: 221-229 vs 66-251, of 16: 332 vs 353-366;
# prefill of 512 tokens: 1064 vs 1867-1893. Small decode steps are mostly one-thread GEMVs and
# per-op overheads that a second OpenMP thread only slows down.
PARALLEL_DECODE_MIN_SEQS = 16


class ModelRunner:
    """Owns the KV cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of one worker.

    Threads per phase: a decode step (every sequence feeds one token) of fewer than
    ``PARALLEL_DECODE_MIN_SEQS`` sequences runs with ``decode_threads`` torch threads; every other step
    (prefill, mixed, large decode batches) with the thread count set when the runner was built
    (``--torch-threads``). ``decode_threads`` 0 means the same for all steps.
    """

    def __init__(self, lm: LoadedModel, kv_cache: torch.Tensor, block_size: int, decode_threads: int = 0) -> None:
        self.lm = lm
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.prefill_threads = torch.get_num_threads()
        self.decode_threads = min(decode_threads, self.prefill_threads) or self.prefill_threads

    def threads_for(self, num_tokens: int, num_seqs: int) -> int:
        """Torch threads of a step feeding ``num_tokens`` tokens of ``num_seqs`` sequences (see the class doc)."""
        small_decode = num_tokens == num_seqs < PARALLEL_DECODE_MIN_SEQS
        return self.decode_threads if small_decode else self.prefill_threads

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
        threads = self.threads_for(len(input_ids), len(seqs))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        with torch.inference_mode():
            logits = self.lm.model(
                torch.tensor(input_ids, dtype=torch.long),
                torch.tensor(positions, dtype=torch.long),
                self.kv_cache,
                attn,
            )
        rows = [SampleRow(s.params, len(s.output_token_ids), s.prompt_token_ids, s.output_token_ids,
                          eos_token_ids=self.lm.eos_token_ids) for s in seqs]
        return [r.token_id for r in sample(logits, rows)]
