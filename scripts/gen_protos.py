"""Generate the pd.v1 Python stubs from protos/ into gen/ (committed; tests check they are current).

Usage: python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

ROOT = Path(__file__).resolve().parents[1]


def generate(out: Path) -> None:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'protos'}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(ROOT / "protos")) for p in protos],
    ]
    # protoc resolves relative proto paths against -I; run from protos/.
    import os

    cwd = os.getcwd()
    os.chdir(ROOT / "protos")
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        sys.exit(f"protoc failed with exit code {rc}")
    for pkg in {p.parent.relative_to(ROOT / "protos") for p in protos} | {Path("pd")}:
        init = out / pkg / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        init.touch()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "gen")
    generate(ap.parse_args().out)


if __name__ == "__main__":
    main()
