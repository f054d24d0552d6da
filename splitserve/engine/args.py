"""Command-line flags shared by every process that runs an engine (prefill, decode, colocated; ``up``
passes them on to its workers)."""

from __future__ import annotations

import argparse

from splitserve.dtypes import DTYPE_CHOICES
from splitserve.engine.config import EngineConfig
from splitserve.engine.device import DEVICE_HELP
from splitserve.env import env_bool, env_choice, env_float, env_int, env_str
from splitserve.paths import default_model_path

TRANSPORTS = ("ucx", "inproc")


def add_engine_args(ap: argparse.ArgumentParser, *, prefix_caching: bool = True) -> None:
    """The engine flags; ``prefix_caching`` is this command's default of ``--enable-prefix-caching``."""
    ap.add_argument("--model", default=env_str("PD_MODEL", str(default_model_path())), help="HF folder or .gguf file")
    ap.add_argument("--block-size", type=int, default=env_int("PD_BLOCK_SIZE", 16), help="tokens per KV block")
    ap.add_argument("--kv-cache-mb", type=int, default=env_int("PD_KV_CACHE_MB", 256), help="KV pool size, MiB")
    ap.add_argument("--num-blocks", type=int, default=env_int("PD_NUM_BLOCKS", 0),
                    help="KV pool size in blocks (overrides --kv-cache-mb); 0 = as many as --kv-cache-mb holds")
    ap.add_argument("--max-queue-len", type=int, default=env_int("PD_MAX_QUEUE_LEN", 1024),
                    help="requests (and KV block allocations) that may wait for free KV blocks at once; more are refused "
                         "with RESOURCE_EXHAUSTED")
    ap.add_argument("--max-queue-wait-s", type=float, default=env_float("PD_MAX_QUEUE_WAIT_S", 30.0),
                    help="longest wait for free KV blocks before RESOURCE_EXHAUSTED (inf = no bound; a deadline or "
                         "cancel still ends the wait)")
    ap.add_argument("--max-num-seqs", type=int, default=env_int("PD_MAX_NUM_SEQS", 64), help="most sequences in one batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=env_int("PD_MAX_NUM_BATCHED_TOKENS", 0),
                    help="prompt tokens per prefill batch (0: 4096, at least --max-model-len); with "
                         "--enable-chunked-prefill, tokens per step, running decodes included (0: 512, measured on a "
                         "2-core CPU)")
    ap.add_argument("--enable-chunked-prefill", action="store_true",
                    default=env_bool("PD_ENABLE_CHUNKED_PREFILL"),
                    help="mix running decodes and prompt chunks in each step (Sarathi-style token budget)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=env_bool("PD_ENABLE_PREFIX_CACHING", prefix_caching),
                    help="keep finished requests' full KV blocks (LRU, evicted only when no block is free) and skip "
                         f"computing a prompt's cached prefix (vLLM's automatic prefix caching; default here: "
                         f"{'on' if prefix_caching else 'off'})")
    ap.add_argument("--torch-threads", type=int, default=env_int("PD_TORCH_THREADS", 0),
                    help="torch threads of prefill (and mixed) steps; 0: as many as the CPUs of --cpus, else "
                         "(unpinned) all CPUs this process may use for `colocated`, 1 for a worker beside others")
    ap.add_argument("--decode-threads", type=int, default=env_int("PD_DECODE_THREADS", -1),
                    help="torch threads of decode steps of fewer than 16 sequences (0: as --torch-threads; -1: auto: "
                         "as --torch-threads, except 1 for float32 weights on torch.mm (no CPU GEMM kernel: "
                         "PD_CPU_KERNELS=0, no AVX2 or no g++), where a second thread made such steps slower)")
    ap.add_argument("--cpus", default=env_str("PD_CPUS", ""),
                    help="pin this process's threads to these CPUs (e.g. 0 or 0,2-3), so workers sharing a machine do not "
                         "fight over cores; empty: no pinning")
    ap.add_argument("--dtype", default=env_choice("PD_DTYPE", DTYPE_CHOICES, "auto"), choices=DTYPE_CHOICES,
                    help="weights and KV cache dtype; auto = the checkpoint's (config.json torch_dtype; a GGUF "
                         "file's weight type, float32 for quantized ones). On the CPU kernels bfloat16/float16 "
                         "are weight-only: 16-bit storage, float32 arithmetic")
    ap.add_argument("--max-model-len", type=int, default=env_int("PD_MAX_MODEL_LEN", 0),
                    help="context limit in tokens (prompt + output); 0 = the model's; above it is a start-up error")
    ap.add_argument("--transport", default=env_choice("PD_KV_TRANSPORT", TRANSPORTS, "ucx"), choices=TRANSPORTS, help="KV transfer backend")
    add_device_args(ap)


def add_device_args(ap: argparse.ArgumentParser) -> None:
    """``--device`` and ``--enforce-eager`` (also on commands that build a model without the other engine flags)."""
    ap.add_argument("--device", default=env_str("PD_DEVICE", "cpu"),
                    help=f"where the engine computes: {DEVICE_HELP}; weights, KV cache and sampler live there (PD_DEVICE)")
    ap.add_argument("--enforce-eager", action="store_true", default=env_bool("PD_ENFORCE_EAGER"),
                    help="cuda: run decode steps eagerly instead of replaying CUDA graphs per batch-size bucket "
                         "(vLLM's flag; cpu: always eager)")


def check_max_model_len(model: str, max_model_len: int) -> None:
    """Raises ValueError when ``max_model_len`` exceeds the context length of ``model`` (read without
    weights); a model that cannot be read here is left to fail when the engine loads it."""
    if max_model_len <= 0:
        return
    from splitserve.model import load_model

    try:
        limit = load_model(model, weights=False).max_model_len
    except (OSError, ValueError, NotImplementedError):
        return
    if max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's maximum context length {limit}")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags. Raises ValueError for a setting out of range, including a
    ``--max-model-len`` above the model's context length and a ``--device`` spelled other than cpu / cuda /
    cuda:N. Loads no torch (``splitserve up`` checks its workers' settings with it): whether this machine has
    that GPU is :func:`splitserve.engine.device.check_device_available`'s, which ``splitserve <command>`` runs."""
    check_max_model_len(args.model, args.max_model_len)
    return EngineConfig(
        block_size=args.block_size, kv_cache_mb=args.kv_cache_mb, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=args.enable_chunked_prefill,
        num_blocks=args.num_blocks, max_queue_len=args.max_queue_len, max_queue_wait_s=args.max_queue_wait_s,
        dtype=args.dtype, max_model_len=args.max_model_len, decode_threads=args.decode_threads,
        enable_prefix_caching=args.enable_prefix_caching, device=args.device, enforce_eager=args.enforce_eager,
    )
