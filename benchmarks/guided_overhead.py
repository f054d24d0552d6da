"""Grammar libraries for structured outputs: llguidance vs xgrammar on this machine (prints numbers; not a test).

For each tokenizer (the shipped TinyStories-656K, 2048 SentencePiece-style tokens; stories260K.gguf's 512 tokens
with 256 byte-fallback tokens; and a 32k byte-level BPE trained here offline on the Python standard library's
sources, standing in for a GPT-2/Llama-3 size vocabulary) it measures:

- tokenizer info: building the library's per-tokenizer index once (ms);
- compile: turning a JSON schema / a regex into a matcher ready to use (ms; cache off);
- per token: ``fill mask + accept`` while replaying the tokens of a valid document (µs per token), both the
  library's packed int32 bitmask alone and with the conversion to the bool ``[vocab]`` mask
  ``splitserve.engine.guided`` hands the sampler.

    .venv/bin/python benchmarks/guided_overhead.py [--reps 5] [--no-xgrammar]

xgrammar is optional here (it is not a dependency: it pulls triton, transformers and apache-tvm-ffi);
install it with ``pip install --no-deps xgrammar apache-tvm-ffi`` to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import tokenizers
import torch

ROOT = Path(__file__).resolve().parents[1]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Lily Smith", "age": 31, "email": "lily@example.com", "role": "admin",
                       "address": {"street": "12 Park Lane", "city": "London"}, "tags": ["red", "small", "happy"],
                       "score": 0.75})
REGEX = r"[A-Z][a-z]+ (is|was) [0-9]{1,3} years old\."
REGEX_TEXT = "Tom was 42 years old."


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def bpe_32k() -> tokenizers.Tokenizer:
    """A 32000-token byte-level BPE trained on the standard library's sources (offline, deterministic input)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    return tok


def unpack_into_bool(bitmask: torch.Tensor, mask: torch.Tensor) -> None:
    """mask &= bits of ``bitmask`` (int32 [ceil(V/32)], bit j of word i = token 32*i+j), as splitserve.engine.guided does."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: mask.numel()]
    m = mask.numpy()
    np.logical_and(m, bits, out=m)


class Llg:
    name = "llguidance"

    def __init__(self, hf: tokenizers.Tokenizer, eos: int, vocab: int):
        import llguidance

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(hf.to_str(), n_vocab=vocab, eos_token=eos)
        self.info_ms = _ms(t0)
        self.vocab = vocab

    def compile(self, kind: str, text: str):
        g = self.llg.LLMatcher.grammar_from_json_schema(text) if kind == "json" else self.llg.LLMatcher.grammar_from_regex(text)
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fresh(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)


class Xgr:
    name = "xgrammar"

    def __init__(self, hf: tokenizers.Tokenizer, eos: int, vocab: int):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf)
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.info_ms = _ms(t0)

    def compile(self, kind: str, text: str):
        return self.compiler.compile_json_schema(text) if kind == "json" else self.compiler.compile_regex(text)

    def fresh(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask.view(1, -1))

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


def canonical_tokens(hf: tokenizers.Tokenizer, eos: int, vocab: int, text: str) -> list[int]:
    """Tokens of ``text`` as generated text (no SentencePiece leading-space token), the same for both libraries."""
    import llguidance

    return llguidance.LLTokenizer(hf.to_str(), n_vocab=vocab, eos_token=eos).tokenize_str(text)


def replay(lib, compiled, tokens: list[int], vocab: int, to_bool: bool) -> float:
    """µs per token for fill mask (+ bool conversion) + accept over ``tokens``; checks every token is allowed."""
    m = lib.fresh(compiled)
    bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    t0 = time.perf_counter()
    for t in tokens:
        lib.fill(m, bitmask)
        if to_bool:
            mask = torch.ones(vocab, dtype=torch.bool)
            unpack_into_bool(bitmask, mask)
        if not (int(bitmask[t // 32]) >> (t % 32)) & 1 or not lib.accept(m, t):
            raise RuntimeError(f"{lib.name} refused token {t} of a valid document")
    return (time.perf_counter() - t0) * 1e6 / len(tokens)


def bench(label: str, hf: tokenizers.Tokenizer, eos: int, libs: list[type], reps: int) -> None:
    vocab = hf.get_vocab_size(with_added_tokens=True)
    cases = [("json", json.dumps(SCHEMA), DOCUMENT), ("regex", REGEX, REGEX_TEXT)]
    print(f"\n== {label}: vocab {vocab}")
    if not any(t.startswith("<0x") for t in hf.get_vocab()) and "{" not in "".join(hf.get_vocab()):
        print("(no '{' token and no byte fallback: this vocabulary cannot write JSON; regex only)")
        cases = cases[1:]
    for cls in libs:
        lib = cls(hf, eos, vocab)
        print(f"{lib.name:11s} tokenizer info {lib.info_ms:8.1f} ms (once per tokenizer)")
        for kind, grammar, text in cases:
            tokens = canonical_tokens(hf, eos, vocab, text)
            compile_ms, raw, full = [], [], []
            for _ in range(reps + 1):  # the first round warms up
                t0 = time.perf_counter()
                compiled = lib.compile(kind, grammar)
                compile_ms.append(_ms(t0))
                raw.append(replay(lib, compiled, tokens, vocab, to_bool=False))
                full.append(replay(lib, compiled, tokens, vocab, to_bool=True))
            compile_ms, raw, full = compile_ms[1:], raw[1:], full[1:]
            print(f"{lib.name:11s} {kind:5s} compile {statistics.median(compile_ms):7.2f} ms | per token: bitmask+accept "
                  f"{statistics.median(raw):7.1f} µs, with bool mask {statistics.median(full):7.1f} µs ({len(tokens)} tokens)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-xgrammar", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs: list[type] = [Llg]
    if not args.no_xgrammar:
        try:
            import xgrammar  # noqa: F401
            libs.append(Xgr)
        except ImportError:
            print("xgrammar not installed: llguidance only")
    tiny = tokenizers.Tokenizer.from_file(str(ROOT / "models/TinyStories-656K/tokenizer.json"))
    bench("TinyStories-656K tokenizer (SentencePiece BPE, no byte tokens)", tiny, 2, libs, args.reps)
    from splitserve.model import load_model

    gguf = load_model(ROOT / "models/stories260K.gguf", weights=False).tokenizer
    bench("stories260K.gguf tokenizer (SentencePiece BPE, 256 byte-fallback tokens)", gguf.hf, gguf.eos_token_ids[0], libs, args.reps)
    t0 = time.perf_counter()
    big = bpe_32k()
    print(f"\n(trained the 32k byte-level BPE in {_ms(t0) / 1e3:.1f} s)")
    bench("32k byte-level BPE (trained offline)", big, big.token_to_id("<|endoftext|>"), libs, args.reps)


if __name__ == "__main__":
    main()
