"""Build ``.gpu-wheels/``: the Python wheels the GPU machine lacks, for ``scripts/gpu_check.sh`` to install offline.

The lent GPU machine (``nvidia-h200``, see the device tool's KINDS.md) runs Python 3.12 with torch 2.11 + CUDA 13
preinstalled and reaches no package registry. Its image already has numpy, grpcio's dependencies, pytest, tokenizers,
safetensors, jinja2, httpx, prometheus-client, matplotlib, tqdm, cuda-core / cuda-bindings and nvidia-ml-py; what
splitserve needs beyond that (UCX for CUDA 13, the web stack, OpenTelemetry, gguf, llguidance, pytest-asyncio, a
grpcio / protobuf as new as the generated code wants) is downloaded here, from PyPI, for CPython 3.12 on manylinux
x86-64.

Everything that travels to the device machine (the repository + carried folders) must fit 64 MiB, and
``libucx-cu13`` alone is a 41 MB wheel, most of it static libraries and UCX's perftest programs. ``--slim`` (the
default) rewrites that wheel without them: ``*.a``, ``libucx_perftest*``, ``bin/ucx_perftest``, ``bin/io_demo``;
its RECORD keeps the hashes of every file left, so pip installs it as usual. The runtime libraries (libucp, libucs,
libuct and the cuda / cma / tcp transports) are untouched.

    .venv/bin/python scripts/gpu_wheels.py            # then: run scripts/gpu_check.sh there with carry [".gpu-wheels"]

Raises SystemExit when pip fails or the result with the repository would exceed the limit.
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20

REQUIREMENTS = (
    "ucxx-cu13==0.52.*", "libucx-cu13>=1.19,<1.22", "grpcio>=1.85.1", "grpcio-health-checking>=1.85",
    "protobuf>=7.35.1,<8", "gguf>=0.10", "starlette>=0.40", "uvicorn>=0.30", "pydantic>=2.7", "xxhash>=3.4",
    "opentelemetry-api>=1.45,<2", "opentelemetry-sdk>=1.45,<2", "opentelemetry-exporter-otlp-proto-grpc>=1.45,<2",
    "opentelemetry-exporter-otlp-proto-http>=1.45,<2", "opentelemetry-instrumentation-grpc~=0.66b2",
    "opentelemetry-instrumentation-asgi~=0.66b2", "opentelemetry-proto>=1.45,<2", "llguidance>=1.9,<2",
    "pytest-asyncio>=0.24",
)
"""What splitserve needs (pyproject's dependencies less torch, tokenizers, safetensors, jinja2, httpx, numpy,
prometheus-client, matplotlib, tqdm, which the image has) plus the one test plugin the GPU tests use."""

ON_THE_IMAGE = (
    "numpy", "cuda_bindings", "cuda_core", "cuda_pathfinder", "nvidia_ml_py", "pytest", "pluggy", "iniconfig", "pygments",
    "pyyaml", "tqdm", "requests", "charset_normalizer", "idna", "urllib3", "certifi", "click", "h11", "packaging",
    "typing_extensions", "anyio", "wrapt",
)
"""Distributions (wheel file name prefixes) the image already holds: not carried."""

SLIM_DROP = ("*.a", "*/libucx_perftest*", "*/bin/ucx_perftest", "*/bin/io_demo")

PLATFORMS = ["manylinux2014_x86_64"] + [f"manylinux_2_{v}_x86_64" for v in (17, 24, 27, 28, 31, 34, 35, 39)]


def download(dest: Path) -> None:
    """pip download every requirement (and its dependencies) as CPython 3.12 manylinux wheels into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", "3.12",
           "--disable-pip-version-check", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if subprocess.run([*cmd, *REQUIREMENTS]).returncode != 0:
        raise SystemExit("pip download failed")


def slim(wheel: Path) -> int:
    """Rewrite ``wheel`` without the members matching SLIM_DROP (and their RECORD lines); returns bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        dropped = {i.filename for i in src.infolist() if any(fnmatch.fnmatch(i.filename, p) for p in SLIM_DROP)}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(ln for ln in lines if ln.split(",", 1)[0] not in dropped) + "\n").encode()
            out.writestr(info, data)
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def tree_bytes() -> int:
    """Bytes of the files git would send (tracked + untracked, not ignored)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu-wheels", help="where the wheels go (emptied first)")
    ap.add_argument("--no-slim", dest="slim", action="store_false", help="keep libucx-cu13's static libraries and perftest")
    a = ap.parse_args(argv)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    download(a.out)
    for wheel in sorted(a.out.glob("*.whl")):
        if wheel.name.split("-", 1)[0].lower() in ON_THE_IMAGE:
            wheel.unlink()
        elif a.slim and wheel.name.startswith("libucx_cu13-"):
            print(f"slimmed {wheel.name}: {slim(wheel) / 2**20:.1f} MiB less")
    wheels = sum(w.stat().st_size for w in a.out.glob("*.whl"))
    repo = tree_bytes()
    print(f"{len(list(a.out.glob('*.whl')))} wheels, {wheels / 2**20:.1f} MiB; with the repository "
          f"({repo / 2**20:.1f} MiB): {(wheels + repo) / 2**20:.1f} MiB of the 64 MiB that may travel")
    if wheels + repo > LIMIT_BYTES:
        raise SystemExit("too large to travel to the device machine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
