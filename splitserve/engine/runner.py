"""Model runner: turns scheduled sequences into tensors (slot_mapping, block tables), runs the model, samples."""

from __future__ import annotations

import torch

from splitserve.engine.cuda_graphs import CudaGraphDecoder
from splitserve.engine.device import synchronize
from splitserve.engine.sampler import SampleRow, prompt_logprobs, sample
from splitserve.engine.sequence import Sequence, SeqMode
from splitserve.model import AttentionMetadata, LoadedModel


# Measured with synthetic:llama-25m fp32 on the 2-core AVX2 machine, 1 vs 2 threads (tokens/s): decode of 1
# sequence 70-86 vs 7-36, of 4: 143-152 vs 15-27, of 8: 221-229 vs 66-251, of 16: 332 vs 353-366;
# prefill of 512 tokens: 1064 vs 1867-1893. Small decode steps are mostly one-thread GEMVs and
# per-op overheads that a second OpenMP thread only slows down. Re-measured with the step buffers on a loaded
# machine (load 6-7, benchmarks/results/engine_compile_and_step_buffers.txt): 1 thread still won at batch 1
# (46-72 vs 6-15 tokens/s) and at batch 16 (135-233 vs 34-68); no quiet moment to re-test 2 threads.
PARALLEL_DECODE_MIN_SEQS = 16
# bfloat16 on the same machine (AVX2: no bf16 units, every weight is converted) is compute-bound: single-stream
# decode 67 tokens/s on 1 thread vs 95 on 2, batch 4 37.6 vs 25.3 ms per step (benchmarks/results/peers.md,
# quiet machine). float32 weights packed for splitserve's CPU GEMM kernel (splitserve/kernels/cpu_gemm.py) split
# each weight stream across threads: 2 threads beat 1 at every batch (ms per step, batch 1/4/8/16/32:
# 11.5/13.6/20.7/33.9/59.0 vs 15.2/21.5/31.2/56.1/85.6; benchmarks/results/engine_cpu_kernels.txt). So
# ``decode_threads`` -1 (auto) means 1 thread for float32 on torch.mm and all of them otherwise.


class ModelRunner:
    """Owns the KV cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of one worker.

    Threads per phase: a decode step (every sequence feeds one token) of fewer than
    ``PARALLEL_DECODE_MIN_SEQS`` sequences runs with ``decode_threads`` torch threads; every other step
    (prefill, mixed, large decode batches) with the thread count set when the runner was built
    (``--torch-threads``). ``decode_threads`` 0 means the same for all steps; -1 (auto) 1 for float32
    weights on torch.mm and the same for all steps otherwise (bfloat16/float16, or float32 weights packed for the
    CPU GEMM kernel; see ``PARALLEL_DECODE_MIN_SEQS``).

    Device: the model's and the KV cache's (``device``). On a GPU, a step's inputs go up in one copy and its sampled
    token ids come down in one; decode steps replay CUDA graphs when ``graphs`` is given (see
    ``splitserve.engine.cuda_graphs``). ``sync()`` waits for the queued kernels (no-op on cpu).
    """

    def __init__(self, lm: LoadedModel, kv_cache: torch.Tensor, block_size: int, decode_threads: int = 0,
                 graphs: CudaGraphDecoder | None = None) -> None:
        self.lm = lm
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.prefill_threads = torch.get_num_threads()
        if decode_threads < 0:
            on_mm = lm is None or (lm.config.dtype == "float32" and not getattr(lm.model, "packed_for_cpu", False))
            decode_threads = 1 if on_mm else 0
        self.decode_threads = min(decode_threads, self.prefill_threads) or self.prefill_threads
        self._buffers = StepBuffers(device=self.device)
        self.graphs = graphs

    def sync(self) -> None:
        """Wait until the KV written by queued steps is in memory (before another component reads a block); any
        thread may call it. Steps run on the device's default stream (the engine sets no other)."""
        if self.device.type == "cuda":
            synchronize(self.device)

    def threads_for(self, num_tokens: int, num_seqs: int) -> int:
        """Torch threads of a step feeding ``num_tokens`` tokens of ``num_seqs`` sequences (see the class doc)."""
        small_decode = num_tokens == num_seqs < PARALLEL_DECODE_MIN_SEQS
        return self.decode_threads if small_decode else self.prefill_threads

    def execute(self, seqs: list[Sequence]) -> list[int]:
        """One forward over ``seqs`` (each feeds ``num_step_tokens`` tokens from ``num_computed_tokens``);
        returns one sampled token per sequence (choice 0's; 0 for a partial prefill chunk, which samples nothing).

        Also sets ``seq.step_results`` (SampleResults with logprobs: ``params.n`` of them for an n > 1
        PREFILL_ONLY sequence, else one; None for a partial chunk) and, for a sequence asking for prompt
        logprobs, fills ``seq.prompt_logprobs`` for the prompt positions this step computes."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for seq in seqs:
            start = seq.num_computed_tokens
            end = start + seq.num_step_tokens
            input_ids += _token_slice(seq, start, end)
            table = seq.block_table
            if end - start == 1:  # decode
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(end - start)
            seq_lens.append(end)
        threads = self.threads_for(len(input_ids), len(seqs))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        want_prompt = [_wants_prompt_logprobs(s) for s in seqs]
        if self._graph_step(seqs, seq_lens, want_prompt):
            logits = self.graphs.run(input_ids, positions, slot_mapping, [s.block_table for s in seqs], seq_lens)
            with torch.inference_mode():
                return self._sample(seqs, logits)
        ids_t, pos_t, slots_t = self._buffers.fill(input_ids, positions, slot_mapping)
        attn = AttentionMetadata(
            slot_mapping=slots_t,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=[seq.block_table for seq in seqs],
            block_size=bs,
            on_layer_done=_layer_hook(seqs, self.sync if self.device.type == "cuda" else None),
        )
        logits_indices, last_rows = None, None
        if any(want_prompt):  # every position of those sequences, the last one of the others
            logits_indices, last_rows, t = [], [], 0
            for want, q in zip(want_prompt, query_lens):
                logits_indices += range(t, t + q) if want else [t + q - 1]
                last_rows.append(len(logits_indices) - 1)
                t += q
            logits_indices = torch.tensor(logits_indices, dtype=torch.long)
        with torch.inference_mode():
            logits = self.lm.model(
                ids_t,
                pos_t,
                self.kv_cache,
                attn,
                logits_indices,
            )
            if last_rows is not None:
                for seq, want, last, q in zip(seqs, want_prompt, last_rows, query_lens):
                    if want:
                        _record_prompt_logprobs(seq, logits[last - q + 1 : last + 1])
                logits = logits[torch.tensor(last_rows, dtype=torch.long)]
            return self._sample(seqs, logits)

    def _graph_step(self, seqs: list[Sequence], seq_lens: list[int], want_prompt: list[bool]) -> bool:
        """Whether this step replays a CUDA graph: graphs on, every sequence feeds one token, no prompt logprobs
        or per-layer KV push, and a bucket holds it."""
        return (self.graphs is not None and all(s.num_step_tokens == 1 for s in seqs) and not any(want_prompt)
                and all(s.on_layers is None for s in seqs) and self.graphs.bucket(len(seqs), max(seq_lens)) is not None)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Sample every sequence that completes its prompt or decodes (``logits``: ``[num_seqs, vocab]``)."""
        rows: list[SampleRow] = []
        row_seq: list[int] = []  # logits row of each sample row
        for i, seq in enumerate(seqs):
            seq.step_results = None
            if seq.is_partial_prefill:
                continue
            out = seq.output_token_ids
            if seq.params.n > 1 and seq.mode is SeqMode.PREFILL_ONLY:  # first token of every choice, same logits
                choices = [seq.params.for_choice(c) for c in range(seq.params.n)]
            else:
                choices = [seq.params]
            for params in choices:
                rows.append(SampleRow(params, len(out), seq.prompt_token_ids, out, seq.matcher, self.lm.eos_token_ids))
                row_seq.append(i)
        if not rows:
            return [0] * len(seqs)
        if row_seq != list(range(len(seqs))):
            logits = logits[torch.tensor(row_seq, dtype=torch.long)]
        results = sample(logits, rows)
        for i, res in zip(row_seq, results):
            seq = seqs[i]
            if seq.step_results is None:
                seq.step_results = []
            seq.step_results.append(res)
        return [0 if s.step_results is None else s.step_results[0].token_id for s in seqs]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole KV blocks (every layer's K and V) ``src[i]`` -> ``dst[i]``: copy-on-write of a forked
        sequence's partial last block."""
        if src:
            with torch.inference_mode():
                self.kv_cache[torch.tensor(dst, dtype=torch.long)] = self.kv_cache[torch.tensor(src, dtype=torch.long)]
            self.sync()  # a GPU: the copies are in memory before a transfer writes or reads these blocks

    def copy_block_rows(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy token rows ``[0, num_tokens)`` (every layer's K and V) of KV block ``src`` into block ``dst``:
        copy-on-write of a partial block held by the prefix cache."""
        with torch.inference_mode():
            self.kv_cache[dst, :, :, :num_tokens] = self.kv_cache[src, :, :, :num_tokens]
        self.sync()


class StepBuffers:
    """Preallocated int64 step inputs ``[capacity]`` (input_ids, positions, slot_mapping), written through numpy
    views, so a step allocates no new input tensors (capacity doubles when a step feeds more tokens).
    ``fill`` returns ``[T]`` views that are valid until the next ``fill``: the model must not keep them.

    On a CUDA ``device`` the host buffer is pinned and ``fill`` copies it to a device twin in one transfer: it
    returns input_ids and positions on the device, slot_mapping on the host (the attention plan reads it there)."""

    def __init__(self, capacity: int = 256, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        cuda = self.device.type == "cuda"
        self._t = torch.zeros(3, capacity, dtype=torch.long, pin_memory=cuda)
        self._np = self._t.numpy()
        self._dev = torch.zeros(3, capacity, dtype=torch.long, device=self.device) if cuda else None
        self._copied = torch.cuda.Event() if cuda else None

    def fill(self, input_ids: list[int], positions: list[int], slot_mapping: list[int]) -> tuple[torch.Tensor, ...]:
        """Copy the three equal-length lists in; returns (input_ids, positions, slot_mapping), each int64 ``[T]``."""
        n = len(input_ids)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        if n > self.capacity:
            self._alloc(1 << (n - 1).bit_length())
        a = self._np
        a[0, :n] = input_ids
        a[1, :n] = positions
        a[2, :n] = slot_mapping
        if self._dev is None:
            return self._t[0, :n], self._t[1, :n], self._t[2, :n]
        dev = self._dev[:, :n]
        dev.copy_(self._t[:, :n], non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))  # the copy's stream, also for cuda:N, N > 0
        return dev[0], dev[1], self._t[2, :n]


def _layer_hook(seqs: list[Sequence], sync=None):
    """The step's per-layer callback: tells every sequence with ``on_layers`` whose prompt this step completes that
    layers ``[0, i + 1)`` of its KV are written (None when no sequence asks); ``sync`` (a GPU's) runs first, so
    the layers' KV is in memory when the push reads it."""
    pushes = [s for s in seqs if s.on_layers is not None and not s.is_partial_prefill]
    if not pushes:
        return None

    def done(i: int) -> None:
        if sync is not None:
            sync()
        for s in pushes:
            s.on_layers(s.block_table, i + 1)
    return done


def _token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    """``seq.token_ids[start:end]`` without building prompt + outputs (a decode step reads one token)."""
    prompt, n = seq.prompt_token_ids, len(seq.prompt_token_ids)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return seq.output_token_ids[start - n : end - n]
    return prompt[start:] + seq.output_token_ids[: end - n]


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether this step computes prompt positions whose logprobs ``seq`` still needs (not after its first
    output token: a preempted sequence recomputing its prompt already returned them)."""
    return (seq.params.prompt_logprobs is not None and not seq.output_token_ids
            and seq.num_computed_tokens < len(seq.prompt_token_ids))


def _record_prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """``logits``: ``[num_step_tokens, vocab]`` of prompt positions ``[start, end)``; row ``j`` predicts prompt
    token ``start + j + 1``. Writes entries by position, so a recomputed chunk (preemption) rewrites the same."""
    prompt = seq.prompt_token_ids
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None] * len(prompt)
    start = seq.num_computed_tokens
    end = start + seq.num_step_tokens
    entries = prompt_logprobs(logits, prompt[start : end + 1], seq.params.prompt_logprobs)[1:]
    seq.prompt_logprobs[start + 1 : start + 1 + len(entries)] = entries
