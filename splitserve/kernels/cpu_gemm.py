"""The packed fp32 GEMM of CPU decode steps (``cpu_gemm.cpp``): build, load, pack, call.

A decode step multiplies a few rows (one per running sequence, M = 1..64) by every weight matrix. A general
sgemm (MKL, through ``torch.mm``) packs or strides through the weight on every call and, measured on this
project's 2-core AVX2 machine, ran M = 2..16 at half the speed the weight bytes allow (M = 4 took 2.9x as long
as our kernel; ``benchmarks/cpu_gemm.py``,
``benchmarks/results/engine_cpu_gemm.txt``). Weights are therefore packed once, at load, into 16-column panels
``[ceil(N/16), K, 16]`` that the kernel streams sequentially; it serves every M (prefill too: it matched MKL at
M = 512 on one thread).

The extension is compiled by :func:`torch.utils.cpp_extension.load` (g++ and ninja; ~1 minute, once per source
and torch version) into ``$PD_KERNEL_CACHE`` (default ``~/.cache/splitserve/kernels``); ``make install`` builds
it (``python -m splitserve.kernels.cpu_gemm``), and a process that finds no build makes one (processes that start
together wait on torch's build lock). Used only on a CPU with AVX2 and FMA, for float32 models on the CPU, and
never when ``PD_CPU_KERNELS=0``; if the build fails the model runs on ``torch.mm`` and one warning says why.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from splitserve.env import env_bool

logger = logging.getLogger(__name__)

PANEL = 16  # output columns per packed panel (two AVX2 vectors)
SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's CPU build; without it the kernel runs on one thread
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def enabled() -> bool:
    """``PD_CPU_KERNELS`` is not false and torch reports AVX2 or better on this CPU.

    Raises:
        splitserve.env.EnvError: ``PD_CPU_KERNELS`` is not a boolean."""
    if not env_bool("PD_CPU_KERNELS", True):
        return False
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


def _build_dir(source: bytes) -> Path:
    tag = hashlib.sha256(source + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    root = Path(os.environ.get("PD_KERNEL_CACHE") or Path.home() / ".cache" / "splitserve" / "kernels")
    return root / tag


def _with_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel's binary is not on it in an unactivated venv."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load() -> ModuleType | None:
    """The compiled extension (built first if needed), or None when disabled or the build fails (logged once)."""
    return _load() if enabled() else None


@functools.lru_cache(maxsize=1)
def _load() -> ModuleType | None:
    build_dir = _build_dir(SOURCE.read_bytes() + repr(CFLAGS).encode())
    name = f"splitserve_cpu_gemm_{build_dir.name}"
    built = build_dir / f"{name}.so"
    try:
        if built.exists():  # a finished build of this very source: import it (no compiler or write access needed)
            return _import(name, built)
        build_dir.mkdir(parents=True, exist_ok=True)
        _with_ninja_on_path()
        from torch.utils.cpp_extension import load as load_extension

        started = time.monotonic()
        logger.info("building the CPU GEMM kernel into %s (once, about a minute)", build_dir)
        module = load_extension(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                                build_directory=str(build_dir), verbose=False)
        logger.info("built the CPU GEMM kernel in %.0f s", time.monotonic() - started)
        return module
    except Exception as exc:  # no compiler, no ninja, a read-only cache: run on torch.mm
        lines = str(exc).strip().splitlines()
        logger.warning("CPU GEMM kernel unavailable (%s: %s); float32 matmuls use torch.mm", type(exc).__name__,
                       lines[-1] if lines else "")
        return None


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Pack a Linear weight ``W`` ``[N, K]`` (float32) into panels ``[ceil(N/16), K, 16]``: panel p, row k holds
    ``W[16p : 16p + 16, k]``, zero-padded past N."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[N, K]`` weight back from :func:`pack`'s panels (a copy)."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:n].contiguous()


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T`` (residual optional) with W packed by :func:`pack`.

    Args:
        x: float32 ``[M, K]`` on the CPU (made contiguous if it is not).
        packed: ``[ceil(N/16), K, 16]`` from :func:`pack`.
        n: N, the output columns.
        residual: float32 ``[M, N]`` or None.
    Returns:
        float32 ``[M, N]``.
    Raises:
        RuntimeError: the kernel is not loaded (check :func:`load` first) or shapes/dtypes do not match.
    """
    module = _load()  # weights packed while it was enabled keep running on it
    if module is None:
        raise RuntimeError("the CPU GEMM kernel is not available")
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    return module.packed_gemm(x if x.is_contiguous() else x.contiguous(), packed, n, residual)


def main() -> None:
    """``python -m splitserve.kernels.cpu_gemm``: build (or find) the kernel and say where; exit 1 if unavailable."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not enabled():
        print("CPU GEMM kernel: disabled (PD_CPU_KERNELS=0 or no AVX2 on this CPU); torch.mm serves")
        return
    module = load()
    if module is None:
        raise SystemExit(1)
    print(f"CPU GEMM kernel: {module.__file__}")


if __name__ == "__main__":
    main()
