"""The peers model at bf16 for llama.cpp: ``DIR/llama-25m-seed0.gguf`` with BF16 matrices (norms F32, as llama.cpp's
``convert_hf_to_gguf.py --outtype bf16`` writes them) and ``DIR/llama-25m-seed0`` linked to the float32 HF folder, so
that ``run.py --model-dir DIR --splitserve-args='--dtype bfloat16'`` compares both engines at bf16 weights.

    .venv/bin/python benchmarks/peers/make_bf16_gguf.py [--out DIR]   (default DIR: /tmp/peers-bf16)

Writes with :func:`make_model.write_gguf` (same names, permutation and tokenizer), converting 2-D tensors with
gguf-py's own BF16 conversion (``gguf.quants.quantize``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import make_model


class _BF16Writer(gguf.GGUFWriter):
    def add_file_type(self, ftype: int) -> None:
        super().add_file_type(gguf.LlamaFileType.MOSTLY_BF16)

    def add_tensor(self, name: str, tensor: np.ndarray, **kw) -> None:
        if tensor.ndim != 2:  # norms stay F32
            return super().add_tensor(name, tensor, **kw)
        bf16 = gguf.quants.quantize(tensor.astype(np.float32), gguf.GGMLQuantizationType.BF16)
        return super().add_tensor(name, bf16, raw_shape=bf16.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


def main() -> None:
    from safetensors.torch import load_file

    from splitserve.paths import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/peers-bf16"))
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/splitserve-peers/models",
                    help="where make_model.py wrote the float32 model")
    a = ap.parse_args()
    hf = a.model_dir / make_model.NAME
    if not (hf / "model.safetensors").is_file():
        raise SystemExit(f"no float32 model at {hf}: run benchmarks/peers/make_model.py first")
    a.out.mkdir(parents=True, exist_ok=True)
    link = a.out / make_model.NAME
    if not link.exists():
        link.symlink_to(hf.resolve())
    sd = load_file(str(hf / "model.safetensors"))
    writer, gguf.GGUFWriter = gguf.GGUFWriter, _BF16Writer  # write_gguf builds its writer from the module
    try:
        path = make_model.write_gguf(a.out / f"{make_model.NAME}.gguf", sd, default_model_path())
    finally:
        gguf.GGUFWriter = writer
    print(f"BF16 GGUF: {path}\nHF folder (float32, run with --dtype bfloat16): {link}")


if __name__ == "__main__":
    main()
