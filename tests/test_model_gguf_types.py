"""GGUF tensor types F32, F16, BF16 and Q8_0 load (dequantised at load), written here with gguf's writer from
the shipped stories260K.gguf; ``--dtype auto`` follows the matrix weights' type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from splitserve.model import AttentionMetadata, load_model
from tests.test_model_paged import models_dir

SRC = "stories260K.gguf"


def rewrite(src, dst, qtype: Q) -> None:
    """Copy ``src`` with every matrix weight stored as ``qtype`` (norms stay F32; a Q8_0 matrix whose rows are
    not a multiple of 32 values stays F32, as llama.cpp's converter falls back)."""
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub)
    for t in reader.tensors:
        arr = np.array(t.data, dtype=np.float32)
        if arr.ndim < 2 or (qtype == Q.Q8_0 and arr.shape[-1] % 32):
            writer.add_tensor(t.name, arr)
        elif qtype == Q.F16:
            writer.add_tensor(t.name, arr.astype(np.float16))
        elif qtype == Q.F32:
            writer.add_tensor(t.name, arr)
        else:
            writer.add_tensor(t.name, quantize(arr, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits(lm, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    cache = lm.model.allocate_kv_cache(-(-n // 4), 4)
    meta = AttentionMetadata(torch.arange(n), [n], [n], [list(range(cache.shape[0]))], 4)
    return lm.model(torch.tensor(ids), torch.arange(n), cache, meta)[0]


@pytest.fixture(scope="module")
def reference():
    lm = load_model(models_dir() / SRC)
    return lm, lm.tokenizer.encode("Once upon a time, there was a little")


@pytest.mark.parametrize("qtype, auto, atol", [(Q.F32, "float32", 0.0), (Q.F16, "float16", 2e-3),
                                                (Q.BF16, "bfloat16", 1.6e-2), (Q.Q8_0, "float32", 2e-2)])
def test_gguf_tensor_types_load(tmp_path, reference, qtype, auto, atol):
    ref, ids = reference
    path = tmp_path / f"stories-{qtype.name}.gguf"
    rewrite(models_dir() / SRC, path, qtype)
    assert {t.tensor_type for t in GGUFReader(str(path)).tensors if len(t.shape) == 2} >= {qtype}
    assert load_model(path, dtype="auto", weights=False).config.dtype == auto
    lm = load_model(path, dtype="float32")
    got, want = dict(lm.model.named_parameters()), dict(ref.model.named_parameters())
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=atol * max(1.0, float(w.abs().max())), rtol=0)
    a, b = logits(lm, ids), logits(ref, ids)
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999 and int(a.argmax()) == int(b.argmax())
    if auto != "float32":
        assert torch.isfinite(logits(load_model(path, dtype="auto"), ids)).all()
