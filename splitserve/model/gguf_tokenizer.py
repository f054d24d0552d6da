"""Build a ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Supported ``tokenizer.ggml.model`` values:
  * "llama": sentencepiece-style BPE with byte fallback. Merges come from the file if present, else
    they are recovered from the vocabulary ordered by token score (as transformers' SentencePiece
    converter does). Normalizer Prepend("▁") + Replace(" ", "▁"); decoder Replace("▁", " "),
    ByteFallback, Fuse, Strip(left 1).
  * "gpt2": byte-level BPE with the file's merges (pre-tokenizer regex chosen from tokenizer.ggml.pre).
Token types 3 (control) become special added tokens, 2 (unknown) too, 4 (user-defined) plain added tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary.

    Every split of a token into two in-vocabulary pieces is a merge ranked by the merged token's
    score (higher first; ties by shorter left piece, then shorter right piece, then piece ids).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for merged, score in dict(zip(tokens, scores)).items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _file_merges(meta: dict[str, Any]) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if not raw:
        return None
    out = []
    for m in raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed GGUF merge {m!r}")
        out.append((a, b))
    return out


def _add_typed_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty in (_UNKNOWN, _CONTROL)]
    plain = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)


def build_gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Tokenizer from GGUF metadata (field name -> decoded value).

    Raises:
        ValueError: no vocabulary, or vocab/scores length mismatch.
        NotImplementedError: a tokenizer.ggml.model other than "llama" or "gpt2".
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens vocabulary")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ValueError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
        merges = _file_merges(meta) or merges_from_scores(tokens, scores)
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        norm = [normalizers.Replace(" ", "▁")]
        tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else []) + norm)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    elif kind == "gpt2":
        merges = _file_merges(meta)
        if merges is None:
            raise ValueError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        split = _SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        raise NotImplementedError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (supported: 'llama', 'gpt2')")
    _add_typed_tokens(tok, tokens, types)
    return tok
