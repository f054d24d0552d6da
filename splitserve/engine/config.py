"""Engine settings: a plain frozen dataclass (no torch), so configs and ``splitserve up`` can check them."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.dtypes import DTYPE_CHOICES
from splitserve.engine.device import check_device

DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096  # unchunked: prompt tokens per prefill batch (raised to max_model_len)
# Chunked: tokens per step (decodes + prompt chunk). Measured with benchmarks/chunked_itl.py on the 2-core
# machine (synthetic:llama-25m fp32): see benchmarks/results/chunked_itl.md.
DEFAULT_CHUNKED_BUDGET = 512


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes and limits of one engine: KV block size and pool, batch limits, admission queue."""

    block_size: int = 16  # tokens per KV block
    kv_cache_mb: int = 256  # size of the preallocated KV pool, MiB
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0  # prompt tokens per prefill batch; with chunking, tokens per step; 0 = default
    enable_chunked_prefill: bool = False  # Sarathi-style: decodes + prompt chunks share each step
    num_blocks: int = 0  # KV pool size in blocks; 0 = as many as kv_cache_mb holds
    max_queue_len: int = 1024  # requests + block allocations waiting for KV blocks / a batch slot; more are refused
    max_queue_wait_s: float = 30.0  # a request still waiting after this fails with RESOURCE_EXHAUSTED (inf: never)
    dtype: str = "auto"  # weights and KV cache: auto (the checkpoint's) | float32 | bfloat16 | float16
    max_model_len: int = 0  # context limit, tokens (prompt + output); 0 = the model's
    decode_threads: int = -1  # torch threads of small decode-only steps (0: as prefill steps; -1: by dtype, see ModelRunner)
    enable_prefix_caching: bool = False  # keep full KV blocks for reuse (engine.prefix_cache); CLI: on for decode, colocated
    device: str = "cpu"  # cpu | cuda | cuda:N: weights, KV cache, step buffers and sampler live there
    enforce_eager: bool = False  # cuda: no CUDA graphs for decode steps (vLLM's --enforce-eager); cpu: always eager

    def __post_init__(self) -> None:
        """Raises ValueError naming the first setting out of range (flag spelling, as the CLI prints it); a
        ``device`` spelled other than cpu / cuda / cuda:N too (whether a GPU is there is checked at start-up)."""
        check_device(self.device)
        for flag, value, ok, want in (
            ("--block-size", self.block_size, self.block_size >= 1, ">= 1"),
            ("--kv-cache-mb", self.kv_cache_mb, self.kv_cache_mb >= 1, ">= 1"),
            ("--max-num-seqs", self.max_num_seqs, self.max_num_seqs >= 1, ">= 1"),
            ("--max-num-batched-tokens", self.max_num_batched_tokens, self.max_num_batched_tokens >= 0,
             ">= 0 (0: the default for the chunking mode)"),
            ("--num-blocks", self.num_blocks, self.num_blocks >= 0, ">= 0 (0: as many as --kv-cache-mb holds)"),
            ("--max-queue-len", self.max_queue_len, self.max_queue_len >= 1, ">= 1"),
            ("--max-queue-wait-s", self.max_queue_wait_s, self.max_queue_wait_s > 0, "> 0"),
            ("--dtype", self.dtype, self.dtype in DTYPE_CHOICES, f"one of {', '.join(DTYPE_CHOICES)}"),
            ("--max-model-len", self.max_model_len, self.max_model_len >= 0, ">= 0 (0: the model's context length)"),
            ("--decode-threads", self.decode_threads, self.decode_threads >= -1,
             ">= -1 (0: as many as --torch-threads; -1: by dtype)"),
        ):
            if not ok:
                raise ValueError(f"{flag} must be {want}, got {value}")

    def token_budget(self, max_model_len: int) -> int:
        """Tokens one step may feed: with chunked prefill ``max_num_batched_tokens`` (0: DEFAULT_CHUNKED_BUDGET),
        every running decode included; without, prompt tokens per prefill batch (0: DEFAULT_MAX_NUM_BATCHED_TOKENS),
        at least ``max_model_len`` so that every prompt fits one batch."""
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens or DEFAULT_CHUNKED_BUDGET
        return max(self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
