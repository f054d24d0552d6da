"""Build and load splitserve's CPU kernels, one C++ extension: ``cpu_kernels.cpp`` (:mod:`~splitserve.kernels.cpu_gemm`'s
packed GEMM, :mod:`~splitserve.kernels.paged_decode`'s decode attention), ``cpu_layer_ops.cpp``
(:mod:`~splitserve.kernels.layer_ops`: RMSNorm, SiLU * up, RoPE + KV store) and ``cpu_decoder_layer.cpp``
(:mod:`~splitserve.kernels.decoder_layer`: those kernels as one call per layer of a decode step).

The extension is compiled by :func:`torch.utils.cpp_extension.load` (g++ and ninja; ~1 minute, once per source
and torch version) into ``$PD_KERNEL_CACHE`` (default ``~/.cache/splitserve/kernels``); ``make install`` builds
it (``python -m splitserve.kernels.build``), and a process that finds no build makes one (processes that start
together take turns on an ``flock``, which a killed builder cannot leave held). Used only on a CPU with AVX2, FMA
and F16C (every AVX2 CPU has the last two), for float32, bfloat16 and float16 models on the CPU, and never when
``PD_CPU_KERNELS=0``; if the build fails the model runs on torch (``torch.mm``, SDPA) and one warning says why.
"""

from __future__ import annotations

import fcntl
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

HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_kernels.cpp", HERE / "cpu_layer_ops.cpp", HERE / "cpu_decoder_layer.cpp"]
HEADERS = [HERE / "cpu_simd.h", HERE / "cpu_kernels.h"]
# -fopenmp: the kernels split their work with OpenMP pragmas (ignored without it: one thread); torch's CPU build
# links the same libgomp, so both share one OpenMP runtime
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


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


def loaded() -> ModuleType | None:
    """The extension whatever ``PD_CPU_KERNELS`` says now (weights packed while it was on keep running on it)."""
    return _load()


def required() -> ModuleType:
    """:func:`loaded`, for a caller about to run a kernel.

    Raises:
        RuntimeError: the kernels are not available (check :func:`load` first)."""
    module = _load()
    if module is None:
        raise RuntimeError("splitserve's CPU kernels are not available")
    return module


@functools.lru_cache(maxsize=1)
def _load() -> ModuleType | None:
    build_dir = _build_dir(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + repr(CFLAGS).encode())
    name = f"splitserve_cpu_kernels_{build_dir.name}"
    built = build_dir / f"{name}.so"
    try:
        if built.exists():  # a finished build of this very source: import it (no compiler or write access needed)
            return _import(name, built)
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "splitserve.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # one builder at a time; the OS lets go if the holder dies
            if built.exists():  # another process built it while this one waited
                return _import(name, built)
            clear_stale_torch_lock(build_dir)
            _with_ninja_on_path()
            from torch.utils.cpp_extension import load as load_extension

            started = time.monotonic()
            logger.info("building splitserve's CPU kernels into %s (once, about a minute)", build_dir)
            module = load_extension(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
            logger.info("built splitserve's CPU kernels in %.0f s", time.monotonic() - started)
            return module
    except Exception as exc:  # no compiler, no ninja, a read-only cache: run on torch.mm
        lines = str(exc).strip().splitlines()
        logger.warning("CPU kernels unavailable (%s: %s); models run on torch.mm and SDPA", type(exc).__name__,
                       lines[-1] if lines else "")
        return None


def clear_stale_torch_lock(build_dir: Path) -> bool:
    """Remove torch's build lock file (``lock``, its FileBaton) from ``build_dir``; True if there was one.

    Call only while holding ``splitserve.lock`` (every splitserve builder takes it first): torch's file stays behind
    when its builder is killed, and every later build would then wait on it forever (seen when a test killed a worker
    that was compiling)."""
    stale = build_dir / "lock"
    if not stale.exists():
        return False
    logger.warning("removing a stale kernel build lock left by a killed build: %s", stale)
    stale.unlink(missing_ok=True)
    return True


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """``python -m splitserve.kernels.build``: build (or find) the kernel and say where; exit 1 if unavailable."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not enabled():
        print("CPU kernels: disabled (PD_CPU_KERNELS=0 or no AVX2 on this CPU); torch.mm serves")
        return
    module = load()
    if module is None:
        raise SystemExit(1)
    print(f"CPU kernels: {module.__file__}")


if __name__ == "__main__":
    main()
