"""The control plane loads no torch: the router, `splitserve up` (cli + launcher) and the KV store master
import neither torch, ucxx nor numpy; the storage node imports no torch (it needs numpy and UCX for its
segment). Checked in a fresh interpreter per module, and on a running `splitserve up` through the
libraries each process has mapped."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from splitserve.dtypes import DTYPE_ITEMSIZE, itemsize
from splitserve.launcher import free_port
from splitserve.model.info import load_model_info
from splitserve.paths import MODELS_DIR
from splitserve.served_model import load_served_model
from splitserve.transfer.layout import KVLayout
from tests.cluster import TEST_ENV, read_up_banner

HEAVY = ("torch", "ucxx", "numpy")


def loaded_heavy_packages(code: str) -> list[str]:
    """Top-level packages of HEAVY in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = f"{code}; import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", [
    "splitserve.services.router.main",
    "splitserve.launcher",
    "splitserve.cli",
    "splitserve.services.kvstore.master.main",
    "splitserve.served_model",
    "splitserve.transfer",
    "splitserve.model",
])
def test_control_plane_module_imports_no_torch_ucxx_or_numpy(module):
    assert loaded_heavy_packages(f"import {module}") == []


def test_store_node_imports_no_torch():
    assert "torch" not in loaded_heavy_packages("import splitserve.services.kvstore.node.main")


def test_up_checks_worker_settings_without_torch():
    """`splitserve up` parses each process's flags with its config module before starting anything."""
    code = ("from splitserve.cli import check_settings; "
            "[check_settings(c, []) for c in ('router', 'prefill', 'decode', 'kvstore-master', 'kvstore-node')]")
    assert loaded_heavy_packages(code) == []


@pytest.mark.parametrize("model", ["TinyStories-656K", "synthetic:llama-tiny"])
def test_router_reads_its_model_without_torch(model):
    path = model if model.startswith("synthetic:") else str(MODELS_DIR / model)
    code = f"from splitserve.served_model import load_served_model; load_served_model({path!r})"
    assert loaded_heavy_packages(code) == []


@pytest.mark.parametrize("name", ["TinyStories-656K", "stories260K.gguf", "synthetic:llama-tiny"])
def test_model_info_equals_what_load_model_reads(name):
    from splitserve.model import load_model

    path = name if name.startswith("synthetic:") else MODELS_DIR / name
    info, full = load_model_info(path), load_model(path, weights=False)
    assert (info.config, info.model_id, info.eos_token_ids, info.max_model_len) == (
        full.config, full.model_id, full.eos_token_ids, full.max_model_len)
    assert info.tokenizer.encode("Once upon a time") == full.tokenizer.encode("Once upon a time")
    served = load_served_model(str(path))
    assert (served.max_model_len, served.tokenizer.eos_token_ids) == (info.max_model_len, info.tokenizer.eos_token_ids)


def test_model_info_errors_match_load_model(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model_info(tmp_path / "missing")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model_info(MODELS_DIR / "TinyStories-656K", dtype="int8")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither a model folder nor a .gguf file"):
        load_model_info(tmp_path / "weights.bin")


def test_itemsize_table_agrees_with_torch():
    import torch

    from splitserve.transfer.kv_cache import allocate_kv_cache, torch_dtype

    assert {"float32", "float16", "bfloat16", "int8"} <= set(DTYPE_ITEMSIZE)
    for name, size in DTYPE_ITEMSIZE.items():
        assert torch.empty(0, dtype=torch_dtype(name)).element_size() == size
    layout = KVLayout("m", 2, 4, 16, 8, "bfloat16")
    cache = allocate_kv_cache(layout, 3)
    assert cache.dtype == torch.bfloat16 and cache[0].numel() * cache.element_size() == layout.block_nbytes
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        itemsize("float8")
    with pytest.raises(ValueError, match="unknown dtype"):
        _ = KVLayout("m", 2, 4, 16, 8, "float8").block_nbytes


# --------------------------------------------------------------------------------------------------------
# a running `splitserve up`


def _children(pid: int) -> dict[str, int]:
    """Role (the `splitserve <role>` command) -> pid of each child of ``pid``."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    roles = {}
    for child in map(int, out.split()):
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        roles[argv[argv.index(b"splitserve.cli") + 1].decode()] = child
    return roles


def _maps_libtorch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_running_up_router_master_and_launcher_map_no_libtorch():
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--kv-cache-mb", "32", "--store-mb", "32"],
        env={**os.environ, **TEST_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        out = "".join(read_up_banner(proc))
        assert "Ctrl-C stops the cluster" in out, out
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",  # the router has served a request
                       json={"model": "TinyStories-656K", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        roles = _children(proc.pid)
        assert {"router", "prefill", "decode", "kvstore-master", "kvstore-node"} <= set(roles), roles
        assert _maps_libtorch(roles["prefill"])  # the check sees torch where it is loaded
        mapped = {role: _maps_libtorch(roles[role]) for role in ("router", "kvstore-master", "kvstore-node")}
        assert mapped == {"router": False, "kvstore-master": False, "kvstore-node": False}
        assert not _maps_libtorch(proc.pid)  # the launcher itself
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
