"""The KV path decision (host / cuda / staged) as a pure function, UCX's transport list, the staging setting, the
KV memory views of each path, the layout's device kind, and CUDA-guarded code importing harmlessly without CUDA."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from splitserve.env import EnvError
from splitserve.errors import KVLayoutMismatch
from splitserve.rpc.convert import layout_from_proto, layout_to_proto
from splitserve.rpc.status import status_for
from splitserve.transfer.common import layout_digest
from splitserve.transfer.kv_cache import allocate_kv_cache, byte_view
from splitserve.transfer.kv_memory import KVMemory, checksum, host_buffer
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import PartialBlock, parts_checksum
from splitserve.transfer.paths import choose_path, staging_from_env, ucx_transports

LAYOUT = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
TCP_ONLY = frozenset({"self", "tcp", "sysv", "posix", "cma"})
WITH_CUDA = TCP_ONLY | {"cuda_copy", "cuda_ipc"}


@pytest.mark.parametrize("device,transports,staging,path", [
    ("cpu", TCP_ONLY, "auto", "host"),
    ("cpu", TCP_ONLY, "never", "host"),
    ("cpu", WITH_CUDA, "auto", "host"),
    ("cpu", TCP_ONLY, "always", "staged"),
    ("cuda", WITH_CUDA, "auto", "cuda"),
    ("cuda", WITH_CUDA, "never", "cuda"),
    ("cuda", WITH_CUDA, "always", "staged"),
    ("cuda", TCP_ONLY, "auto", "staged"),
    ("cuda", {"cuda_ipc"}, "auto", "staged"),  # without cuda_copy UCX cannot touch device memory at all
    ("cuda", TCP_ONLY, "always", "staged"),
])
def test_choose_path(device, transports, staging, path):
    assert choose_path(device, transports, staging) == path


def test_choose_path_refuses():
    with pytest.raises(ValueError, match="no cuda_copy transport"):
        choose_path("cuda", TCP_ONLY, "never")
    with pytest.raises(ValueError, match="auto, always, never"):
        choose_path("cpu", TCP_ONLY, "sometimes")
    with pytest.raises(ValueError, match="cpu, cuda"):
        choose_path("mps", WITH_CUDA, "auto")


def test_ucx_transports_from_context_info():
    info = """#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 2  :  md 1  dev 2  flags -- tcp/lo
#      resource 3  :  md 2  dev 0  flags -- sysv/memory
#      resource 6  :  md 5  dev 0  flags -- cuda_copy/cuda
#      resource 7  :  md 6  dev 3  flags -- cuda_ipc/cuda
#"""
    assert ucx_transports(info) == {"self", "tcp", "sysv", "cuda_copy", "cuda_ipc"}
    assert ucx_transports("") == frozenset()


def test_staging_from_env():
    assert staging_from_env({}) == "auto"
    assert staging_from_env({"PD_KV_TRANSFER_STAGING": "always"}) == "always"
    with pytest.raises(EnvError, match="PD_KV_TRANSFER_STAGING"):
        staging_from_env({"PD_KV_TRANSFER_STAGING": "yes"})


def test_backends_refuse_a_bad_staging_value():
    from splitserve.transfer import create_receiver, create_sender

    cache = allocate_kv_cache(LAYOUT, 2)
    for make in (lambda k: create_sender(k, cache, LAYOUT, staging="on"), lambda k: create_receiver(k, cache, LAYOUT, staging="on")):
        for kind in ("ucx", "inproc"):
            with pytest.raises(ValueError, match="staging"):
                make(kind)


def test_kv_memory_host_path_is_in_place_and_staged_path_copies():
    cache = allocate_kv_cache(LAYOUT, 4)
    flat = byte_view(cache).numpy()
    flat[:] = np.arange(flat.size) % 251
    bn = LAYOUT.block_nbytes
    host, staged = KVMemory(cache, PartialBlock(LAYOUT), "host"), KVMemory(cache, PartialBlock(LAYOUT), "staged")
    assert host.in_place and not staged.in_place
    view = host.send_blocks(1, 2)
    assert np.shares_memory(view, flat) and view.nbytes == 2 * bn
    copy = staged.send_blocks(1, 2)
    assert not np.shares_memory(copy, flat) and np.array_equal(copy, view)
    assert checksum([copy]) == parts_checksum([view])
    incoming = staged.recv_blocks(3, 1)
    assert not np.shares_memory(incoming, flat)
    incoming[:] = 7
    assert not (flat[3 * bn : 4 * bn] == 7).all()  # not landed yet
    staged.land(3 * bn, incoming)
    assert (flat[3 * bn : 4 * bn] == 7).all()
    gathered = staged.gather([2, 0])
    assert np.array_equal(gathered, np.concatenate([flat[2 * bn : 3 * bn], flat[:bn]]))
    with pytest.raises(ValueError, match="does not fit"):
        KVMemory(cache, PartialBlock(LAYOUT), "cuda")
    assert host.fence() is None  # no CUDA event for a host cache


def test_host_buffer_without_cuda():
    buf = host_buffer(64)
    assert buf.dtype == np.uint8 and buf.nbytes == 64


def test_layout_device_may_differ_nothing_else():
    cpu, cuda = LAYOUT.on_device("cpu"), LAYOUT.on_device("cuda")
    assert cpu == cuda and hash(cpu) == hash(cuda) and cuda.device == "cuda"
    assert layout_digest(cpu) == layout_digest(cuda)  # what every UCX request checks
    cpu.check_compatible(cuda)
    for field, value in (("block_size", 8), ("dtype", "float16"), ("num_layers", 3), ("num_kv_heads", 1), ("head_dim", 16)):
        other = KVLayout(**{**{f: getattr(LAYOUT, f) for f in ("model_id", "num_layers", "num_kv_heads", "head_dim",
                                                                "block_size", "dtype")}, field: value, "device": "cuda"})
        assert layout_digest(other) != layout_digest(cpu)
        with pytest.raises(KVLayoutMismatch, match=f"{field} differ.*device=cpu.*device=cuda") as exc:
            cpu.check_compatible(other)
        assert status_for(exc.value).name == "FAILED_PRECONDITION"


def test_layout_device_on_the_wire():
    assert layout_from_proto(layout_to_proto(LAYOUT.on_device("cuda"))).device == "cuda"
    assert layout_from_proto(layout_to_proto(LAYOUT)).device == "cpu"


def test_cuda_guarded_code_imports_harmlessly_without_cuda():
    """With no CUDA device visible, the transfer and store modules import and a host transfer path is chosen."""
    code = ("import splitserve.transfer.ucx_sender, splitserve.transfer.ucx_receiver, splitserve.transfer.inproc, "
            "splitserve.kvstore.kv_blocks, tests.gpu.test_gpu_transfer; "
            "from splitserve.transfer.kv_memory import cuda_available, host_buffer; "
            "assert not cuda_available(); assert host_buffer(8).nbytes == 8; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def test_paths_module_loads_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, splitserve.transfer.paths; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only case")
def test_transports_of_this_process_have_no_cuda_here():
    """The real UCX context of a CPU-only machine: tcp is there, cuda_copy is not (a cuda cache would be staged)."""
    code = ("import asyncio; from splitserve.transfer import ucx_runtime\n"
            "async def main():\n"
            "    ucx_runtime.acquire()\n"
            "    try:\n"
            "        print(sorted(ucx_runtime.transports()))\n"
            "    finally:\n"
            "        ucx_runtime.release()\n"
            "asyncio.run(main())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = set(eval(out.stdout.strip().splitlines()[-1]))
    assert "tcp" in names and "cuda_copy" not in names
    assert choose_path("cuda", names, "auto") == "staged" and choose_path("cpu", names, "auto") == "host"
