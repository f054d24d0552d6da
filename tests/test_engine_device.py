"""--device plumbing on the CPU: flags parse on every engine command and reach EngineConfig, tensors live on cpu,
clear one-line errors for a device this machine lacks or a bad spelling; the CUDA-graph modules import without a
GPU; the graph-bucket choice (pure functions); the fixed-shape decode path (what a CUDA graph captures) run eagerly
on the CPU equals the eager engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from splitserve.colocated.main import parse as parse_colocated
from splitserve.engine import async_engine
from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.cuda_graphs import CudaGraphDecoder, bucket_for, graph_buckets, graphs_enabled
from splitserve.engine.device import check_device, check_device_available
from splitserve.engine.sampling import SamplingParams
from splitserve.model import AttentionMetadata, load_model
from splitserve.up_config import parse as parse_up

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("good", ["cpu", "cuda", "cuda:0", "cuda:7"])
def test_device_spellings_accepted(good):
    assert check_device(good) == good
    assert EngineConfig(device=good).device == good


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "", "mps"])
def test_bad_device_spelling_is_one_clear_error(bad):
    with pytest.raises(ValueError, match=r"^--device must be cpu, cuda or cuda:N, got "):
        check_device(bad)
    with pytest.raises(ValueError, match="--device"):
        EngineConfig(device=bad)


@pytest.mark.skipif(not NO_CUDA, reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_one_clear_error(device):
    with pytest.raises(ValueError, match=rf"^--device {device}: CUDA is not available here \(.*\); use --device cpu$"):
        check_device_available(device)
    assert check_device_available("cpu") == "cpu"


@pytest.mark.skipif(NO_CUDA, reason="needs a GPU")
def test_cuda_index_out_of_range_is_one_clear_error():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"only {n} CUDA device"):
        check_device_available(f"cuda:{n}")


@pytest.mark.parametrize("command", ["prefill", "decode", "colocated", "worker", "up"])
def test_cli_refuses_a_bad_device_in_one_line(command):
    """Usage errors (exit 2) naming the flag, on each engine-bearing command (``up`` checks the spelling; each
    worker it starts checks the GPU)."""
    device = "cuda" if NO_CUDA and command != "up" else "tpu"
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", command, "--device", device],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"splitserve {command}: error: --device") and "Traceback" not in proc.stderr


def test_flags_reach_the_engine_config(monkeypatch):
    monkeypatch.delenv("PD_DEVICE", raising=False)
    args = parse_colocated(["--kv-cache-mb", "1"])
    assert args.device == "cpu" and args.enforce_eager is False
    args = parse_colocated(["--device", "cpu", "--enforce-eager"])
    cfg = async_engine.EngineConfig(device=args.device, enforce_eager=args.enforce_eager)
    assert (cfg.device, cfg.enforce_eager) == ("cpu", True)
    from splitserve.engine.args import engine_config

    assert engine_config(args).device == "cpu" and engine_config(args).enforce_eager
    monkeypatch.setenv("PD_DEVICE", "cpu")
    assert parse_colocated([]).device == "cpu"


def test_up_passes_device_to_every_worker():
    up = parse_up(["--device", "cuda:1", "--enforce-eager", "--no-store"])  # spelling only: no GPU needed here
    args = up.worker_args()
    assert args[args.index("--device") + 1] == "cuda:1" and "--enforce-eager" in args
    assert parse_up(["--no-store"]).worker_args()[-2:] == ["--device", "cpu"]


async def test_cpu_engine_keeps_every_tensor_on_cpu():
    lm = load_model("synthetic:llama-tiny", device="cpu")
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=1, device="cpu"))
    assert engine.device == torch.device("cpu") and engine.kv_cache.device.type == "cpu"
    assert {p.device.type for p in lm.model.parameters()} == {"cpu"} and lm.model.rotary.inv_freq.device.type == "cpu"
    assert engine.core.runner.graphs is None  # cpu: always eager
    assert engine.kv_cache.shape[0] == engine.num_blocks  # no scratch block without graphs
    engine.sync_kv()  # no-op on cpu


def test_engine_refuses_a_model_loaded_elsewhere():
    lm = load_model("synthetic:llama-tiny")
    with pytest.raises(ValueError, match=r"--device cuda: the model was loaded on cpu"):
        AsyncEngine(lm, EngineConfig(kv_cache_mb=1, device="cuda"))


def test_cuda_modules_import_without_touching_cuda():
    code = ("import torch, splitserve.engine.cuda_graphs, splitserve.model.attention_static, splitserve.engine.device, "
            "splitserve.engine.async_engine; assert not torch.cuda.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_graph_buckets_and_choice():
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert graph_buckets(1) == (1,)
    with pytest.raises(ValueError):
        graph_buckets(0)
    b = graph_buckets(48)
    assert [bucket_for(n, b) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert bucket_for(49, b) is None
    assert graphs_enabled("cuda", False) and graphs_enabled("cuda:1", False)
    assert not graphs_enabled("cuda", True) and not graphs_enabled("cpu", False)


def test_decoder_bucket_covers_context_in_blocks():
    lm = load_model("synthetic:llama-tiny")
    dec = CudaGraphDecoder(lm.model, lm.model.allocate_kv_cache(9, 4), 4, max_num_seqs=6, max_model_len=30, scratch_block=8)
    assert dec.batch_buckets == (1, 2, 4, 6) and dec.block_buckets == (1, 2, 4, 8)
    assert dec.bucket(3, 4) == (4, 1) and dec.bucket(3, 5) == (4, 2) and dec.bucket(6, 30) == (6, 8)
    assert dec.bucket(7, 4) is None and dec.bucket(1, 33) is None
    from splitserve.engine.cuda_graphs import MAX_GRAPH_CONTEXT

    long = CudaGraphDecoder(lm.model, lm.model.allocate_kv_cache(9, 16), 16, 4, MAX_GRAPH_CONTEXT * 2, scratch_block=8)
    assert long.block_buckets[-1] == MAX_GRAPH_CONTEXT // 16  # longer contexts decode eagerly
    assert long.bucket(1, MAX_GRAPH_CONTEXT) is not None and long.bucket(1, MAX_GRAPH_CONTEXT + 1) is None


def test_fixed_shape_decode_equals_eager_and_pads_into_the_scratch_block():
    """Three sequences of different lengths, padded to a batch of 4 and 16 blocks: logits within float noise of
    the eager forward; the padding row wrote only the scratch block; every other block is untouched."""
    lm = load_model("synthetic:llama-tiny")
    m, bs = lm.model, 4
    cache = m.allocate_kv_cache(41, bs)
    tables, lens = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]], [17, 9, 38]
    gen = torch.Generator().manual_seed(0)
    for t, n in zip(tables, lens):  # prefill positions 0..n-2
        attn = AttentionMetadata(torch.tensor([t[p // bs] * bs + p % bs for p in range(n - 1)]), [n - 1], [n - 1], [t], bs)
        m(torch.randint(3, 100, (n - 1,), generator=gen), torch.arange(n - 1), cache, attn)
    before = cache.clone()
    ids, pos = [11, 22, 33], [n - 1 for n in lens]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
    eager_cache = cache.clone()
    want = m(torch.tensor(ids), torch.tensor(pos), eager_cache, AttentionMetadata(torch.tensor(slots), [1] * 3, lens, tables, bs))
    dec = CudaGraphDecoder(m, cache, bs, max_num_seqs=8, max_model_len=64, scratch_block=40)
    assert dec.bucket(3, 38) == (4, 16)
    got = dec.run(ids, pos, slots, tables, lens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    written = {s // bs for s in slots}
    for blk in range(40):
        if blk not in written:
            assert torch.equal(cache[blk], before[blk]), blk
    assert not torch.equal(cache[40], before[40])  # the padding row's K/V
    torch.testing.assert_close(cache[:40], eager_cache[:40], rtol=1e-4, atol=1e-5)


async def test_engine_with_fixed_shape_decode_equals_eager_engine(lm, monkeypatch):
    """The whole engine path of CUDA graphs (scratch block, buckets, padding, one upload per step) run eagerly on
    the CPU: greedy tokens of concurrent requests equal the eager engine's."""
    prompts = [lm.tokenizer.encode(t) for t in ("Once upon a time", "Tom and Sue went to the park. They saw a big",
                                                "The cat")]

    async def run(engine):
        await engine.start()
        try:
            async def one(i, p):
                out = []
                async for o in engine.generate(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)):
                    out += o.token_ids
                return out
            import asyncio

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.stop()

    want = await run(AsyncEngine(lm, EngineConfig(kv_cache_mb=2, max_num_seqs=6)))
    monkeypatch.setattr(async_engine, "graphs_enabled", lambda device, eager: True)
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=2, max_num_seqs=6))
    decoder = engine.core.runner.graphs
    assert decoder is not None and decoder.scratch_block == engine.num_blocks == engine.kv_cache.shape[0] - 1
    assert decoder.batch_buckets == (1, 2, 4, 6)
    calls = []
    monkeypatch.setattr(decoder, "run", lambda *a, _run=decoder.run: calls.append(len(a[0])) or _run(*a))
    assert await run(engine) == want
    assert calls and max(calls) == 3  # the decode steps took the fixed-shape path


def test_attention_plan_upload_path_keeps_every_field(monkeypatch):
    """The GPU branch of plan_attention (every index tensor in one copy, masks built on the device), run on the meta
    device: the same fields and shapes as the cpu plan, everything on the cache's device."""
    from splitserve.model.attention import plan_attention

    monkeypatch.setenv("PD_CPU_KERNELS", "0")  # the cpu plan of the torch path (the CPU kernel takes decodes ungrouped)

    bs = 4
    tables = [[0, 1], [2, 3, 4], [5], [6, 7, 8, 9, 10]]
    lens = [(7, 1), (11, 1), (3, 1), (20, 6)]  # (seq_len, query_len): three decodes of two groups, a cached prefill
    slots = [t[p // bs] * bs + p % bs for t, (n, q) in zip(tables, lens) for p in range(n - q, n)]
    attn = AttentionMetadata(torch.tensor(slots), [q for _, q in lens], [n for n, _ in lens], tables, bs)
    shape = (12, 1, 2, bs, 1, 8)
    cpu = plan_attention(attn, len(slots), torch.zeros(shape))
    meta = plan_attention(attn, len(slots), torch.zeros(shape, device="meta"))
    assert len(cpu.decode_groups) == len(meta.decode_groups) == 2 and len(cpu.prefills) == len(meta.prefills) == 1
    pairs = [(cpu.write_blocks, meta.write_blocks), (cpu.write_offsets, meta.write_offsets),
             (cpu.last_token_index, meta.last_token_index), (cpu.prefills[0].blocks, meta.prefills[0].blocks),
             (cpu.prefills[0].mask, meta.prefills[0].mask)]
    for a, b in zip(cpu.decode_groups, meta.decode_groups):
        pairs += [(a.blocks, b.blocks), (a.tokens, b.tokens), (a.mask, b.mask)]
        assert (a.num_blocks, a.length) == (b.num_blocks, b.length)
    for a, b in pairs:
        assert (a is None) == (b is None)
        if a is not None:
            assert b.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype
