"""Write the peer-comparison model: the shape of ``synthetic:llama-25m``, random weights (seed 0), fp32,
as a Hugging Face folder (for splitserve and vLLM) and as an F32 GGUF file (for llama.cpp).

Weights: a ``torch.Generator`` seeded with ``--seed`` (0) draws every matrix from N(0, 0.02²) in sorted
Hugging Face name order; RMSNorm weights are ones. As in ``splitserve.model.synthetic``, the ``lm_head`` rows
of special tokens are zero, so greedy decoding never emits EOS (engines without ``ignore_eos``, i.e.
llama.cpp, still produce exactly ``max_tokens``) and every generated token is visible text (one SSE
chunk per token, so client-side ITL is exact). Embeddings are untied.

Tokenizer: the shipped TinyStories-656K files (sentencepiece-style BPE, vocab 2048, BOS 1, EOS 2). In the
GGUF file it is ``tokenizer.ggml.model = "llama"`` with token scores that follow the merge order
(``score = -rank`` of the merge that produces the token), so llama.cpp's score-driven merging picks the
merges Hugging Face's BPE picks; no ``tokenizer.ggml.merges`` is written (llama.cpp ignores them for this
model type, and splitserve then recovers the merges from the scores as llama.cpp does).

GGUF tensors follow llama.cpp's ``convert_hf_to_gguf.py``: names ``token_embd``, ``blk.N.attn_q`` ..., and the
Q and K rows permuted for llama.cpp's adjacent-pair RoPE (splitserve's GGUF loader undoes it).

Usage: ``python benchmarks/peers/make_model.py [--out DIR]`` writes ``DIR/llama-25m-seed0/`` (HF folder) and
``DIR/llama-25m-seed0.gguf`` (default DIR: ~/.cache/splitserve-peers/models). ~210 MB in all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from splitserve.model.synthetic import synthetic_config
from splitserve.paths import default_model_path

SHAPE = "llama-25m"
NAME = "llama-25m-seed0"
INIT_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
DEFAULT_OUT = Path(os.environ.get("SPLITSERVE_PEERS_HOME", Path.home() / ".cache" / "splitserve-peers")) / "models"
_SPECIAL_IDS = (0, 1, 2)  # <unk>, <|start_story|> (BOS), <|end_story|> (EOS) in the TinyStories vocabulary


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama tensor names -> shapes for ``cfg`` (a ModelConfig); independent of splitserve's modules."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    return shapes


def make_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights with Hugging Face names (shapes: :func:`hf_shapes` of ``synthetic:llama-25m``)."""
    cfg = synthetic_config(SHAPE)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in sorted(hf_shapes(cfg).items()):
        sd[key] = torch.ones(shape) if key.endswith("norm.weight") else torch.randn(shape, generator=gen) * INIT_STD
    sd["lm_head.weight"][list(_SPECIAL_IDS)] = 0.0
    return sd


def hf_config() -> dict:
    """config.json of the model (LlamaForCausalLM, fp32, context 4096)."""
    cfg = synthetic_config(SHAPE)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": cfg.hidden_size,
        "initializer_range": INIT_STD, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "mlp_bias": False,
        "num_attention_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "pretraining_tp": 1, "rms_norm_eps": cfg.rms_norm_eps, "rope_scaling": None,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }


def write_hf_folder(folder: Path, sd: dict[str, torch.Tensor], tokenizer_dir: Path) -> Path:
    """config.json + model.safetensors + the tokenizer files of ``tokenizer_dir`` into ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, folder / name)
    return folder


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` of Q/K rows ``[n_head * head_dim, hidden]``: rotate-half -> adjacent-pair order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_vocab(tokenizer_json: Path) -> tuple[list[str], list[float], list[int]]:
    """(tokens by id, scores, token types) of a sentencepiece-style BPE tokenizer.json.

    A token produced by merge number r scores -r (earlier merges win in llama.cpp's highest-score-first
    merging); other tokens score -(number of merges) - 1. Types: 2 unknown, 3 control, 1 normal.

    Raises:
        ValueError: the vocabulary is not dense 0..n-1, or a merge is malformed.
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    if "" in tokens:
        raise ValueError(f"{tokenizer_json}: vocabulary ids are not dense")
    merges = data["model"]["merges"]
    floor = float(-len(merges) - 1)
    scores = [floor] * len(tokens)
    for rank, merge in enumerate(merges):
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        merged = vocab.get(a + b)
        if merged is None:
            raise ValueError(f"{tokenizer_json}: merge {merge!r} makes a token not in the vocabulary")
        scores[merged] = max(scores[merged], float(-rank))
    unk = data["model"].get("unk_token")
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    types = [2 if tok == unk else 3 if i in special else 1 for i, tok in enumerate(tokens)]
    return tokens, scores, types


def write_gguf(path: Path, sd: dict[str, torch.Tensor], tokenizer_dir: Path) -> Path:
    """The model as an all-F32 GGUF file of architecture ``llama`` with the tokenizer of ``tokenizer_dir``."""
    import gguf

    cfg = synthetic_config(SHAPE)
    tokens, scores, types = gguf_vocab(tokenizer_dir / "tokenizer.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(NAME)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    for n in range(cfg.num_layers):
        p, b = f"model.layers.{n}.", f"blk.{n}."
        arr = {k.removeprefix(p): v.numpy() for k, v in sd.items() if k.startswith(p)}
        w.add_tensor(b + "attn_norm.weight", arr["input_layernorm.weight"])
        w.add_tensor(b + "attn_q.weight", llama_cpp_permute(arr["self_attn.q_proj.weight"], cfg.num_heads))
        w.add_tensor(b + "attn_k.weight", llama_cpp_permute(arr["self_attn.k_proj.weight"], cfg.num_kv_heads))
        w.add_tensor(b + "attn_v.weight", arr["self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", arr["self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", arr["post_attention_layernorm.weight"])
        w.add_tensor(b + "ffn_gate.weight", arr["mlp.gate_proj.weight"])
        w.add_tensor(b + "ffn_up.weight", arr["mlp.up_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", arr["mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_model(out: Path, seed: int = 0, tokenizer_dir: Path | None = None) -> tuple[Path, Path]:
    """Write ``out/<NAME>/`` and ``out/<NAME>.gguf``; returns (HF folder, GGUF file)."""
    tokenizer_dir = tokenizer_dir or default_model_path()
    name = NAME if seed == 0 else f"llama-25m-seed{seed}"
    sd = make_state_dict(seed)
    return write_hf_folder(out / name, sd, tokenizer_dir), write_gguf(out / f"{name}.gguf", sd, tokenizer_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    a = ap.parse_args()
    folder, gguf_path = make_model(a.out, a.seed)
    print(f"HF folder: {folder}\nGGUF file: {gguf_path}")


if __name__ == "__main__":
    main()
