"""Structured outputs: a per-sequence grammar matcher that masks the logits before sampling.

Contract used by the sampler (``splitserve.engine.sampler``) and the engine (one matcher per sequence,
n > 1 forks get one each; on a decode worker the matcher is advanced over the token(s) prefill sampled):

- ``make_matcher(spec, tokenizer, vocab_size)`` compiles (cached per spec) and returns a fresh matcher.
  Raises ``splitserve.errors.InvalidRequest`` for a spec the grammar library refuses.
- ``matcher.fill_mask(mask)``: ``mask`` is a bool tensor ``[vocab_size]``, all True on entry; the matcher
  sets False for every token the grammar forbids next (EOS stays allowed only when the grammar may end).
- ``matcher.accept(token_id) -> bool``: advance over a sampled token; False if the grammar refused it.
- ``matcher.is_terminated() -> bool``: the grammar reached an accepting end (only EOS may follow).

Backed by llguidance (Microsoft's guidance-ai/llguidance, Rust, no Python dependencies): an Earley parser over
lexemes with a token trie, so it needs no per-grammar token-mask precomputation (compile ~1-6 ms) and fills a
mask in ~30-100 µs per token on our vocabularies (benchmarks/guided_overhead.py compares it with xgrammar).

Kinds and the syntax each takes:

- ``json_schema``: JSON Schema (draft 2020-12 subset llguidance implements: objects, arrays, enums, const,
  numbers with bounds, string lengths/patterns/formats, anyOf/oneOf, $ref/$defs). Compact output: no
  whitespace between tokens (``{"a":1,"b":[2,3]}``), so a small model cannot wander into endless whitespace.
  Objects are closed (``additionalProperties: false`` unless the schema says otherwise: OpenAI's strict mode and
  vLLM's default, see :mod:`.json_schema_strict`).
- ``json_object``: any JSON object (``{"type": "object"}``).
- ``regex``: the whole output matches the pattern (Rust ``regex`` syntax, like Python's for common patterns).
- ``choice``: the output is exactly one of the strings (``spec`` = JSON list of strings).
- ``grammar``: a Lark grammar (llguidance's dialect: ``start: ...``, ``/regex/`` terminals, ``%json {...}``)
  or a llama.cpp GBNF / EBNF grammar (``root ::= ...``), converted to Lark by llguidance.

EOS: the ids that end a sequence are ``tokenizer.eos_token_ids`` unless ``eos_token_ids`` is given (pass the
model's, e.g. ``LoadedModel.eos_token_ids``, which include generation_config's). Tokens the grammar can never
emit are always masked: special tokens other than EOS, and the model's padding rows (``vocab_size`` may
exceed the tokenizer's vocabulary).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import llguidance
import numpy as np
import torch

from splitserve.engine.json_schema_strict import close_objects
from splitserve.engine.guided_spec import GuidedSpec
from splitserve.errors import InvalidRequest

COMPILED_CACHE_SIZE = 256
"""Compiled grammars kept per process (LRU over (tokenizer index, spec))."""

MAX_TOKENIZERS = 8
"""Tokenizer indexes kept per process (a server has one; tests make many)."""

JSON_OPTIONS = {"whitespace_flexible": False}
"""llguidance JSON compile options: separators "," and ":" with no whitespace."""


class GuidedMatcher(Protocol):
    def fill_mask(self, mask: torch.Tensor) -> None: ...

    def accept(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


class TokenizerIndex:
    """llguidance's view of one tokenizer (token bytes, trie), built once per (tokenizer, vocab_size, EOS ids).

    Attributes:
        ll: the ``llguidance.LLTokenizer``.
        vocab_size: the model's vocabulary (mask length, tokens).
        eos_token_ids: ids that end a sequence.
        never: bool ``np.ndarray [vocab_size]``, True for tokens no grammar may emit (non-EOS specials, padding rows).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        hf = tokenizer.hf
        tok_vocab = hf.get_vocab_size(with_added_tokens=True)
        if not eos_token_ids:
            raise InvalidRequest("structured outputs need an EOS token; this model's tokenizer has none")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.ll = llguidance.LLTokenizer(hf.to_str(), n_vocab=max(vocab_size, tok_vocab), eos_token=list(eos_token_ids))
        self.words = (self.ll.vocab_size + 31) // 32
        never = np.zeros(vocab_size, dtype=bool)
        never[min(tok_vocab, vocab_size):] = True
        specials = [i for i, t in hf.get_added_tokens_decoder().items() if t.special and i < vocab_size]
        never[specials] = True
        never[[i for i in eos_token_ids if i < vocab_size]] = False
        self.never = never


_indexes: dict[tuple[int, int, tuple[int, ...]], tuple[Any, TokenizerIndex]] = {}
_compiled: OrderedDict[tuple[TokenizerIndex, GuidedSpec], llguidance.LLMatcher] = OrderedDict()
_lock = threading.Lock()


def tokenizer_index(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None) -> TokenizerIndex:
    """The (cached) :class:`TokenizerIndex` of ``tokenizer`` (a ``splitserve.model.tokenizer.Tokenizer``)."""
    eos = tuple(int(i) for i in (tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids))
    key = (id(tokenizer), int(vocab_size), eos)
    with _lock:
        hit = _indexes.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    index = TokenizerIndex(tokenizer, int(vocab_size), eos)
    with _lock:
        _indexes[key] = (tokenizer, index)  # holds the tokenizer so its id() is never reused
        while len(_indexes) > MAX_TOKENIZERS:
            _indexes.pop(next(iter(_indexes)))
    return index


def _grammar(spec: GuidedSpec) -> str:
    """llguidance grammar text for ``spec``. Raises InvalidRequest for a malformed spec."""
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.spec)
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("json_schema must be a JSON object (a JSON Schema)")
            return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequest("choice must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", spec.spec)
        return llguidance.grammar_from("grammar", spec.spec)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{spec.kind} is not valid JSON: {e}") from None
    except ValueError as e:
        raise InvalidRequest(f"invalid {spec.kind}: {e}") from None


def _first_line(text: str, limit: int = 300) -> str:
    """The library's error message on one line (its first lines, whitespace collapsed)."""
    head = " ".join(" ".join(text.strip().splitlines()[:4]).split())
    return (head or "rejected by the grammar library")[:limit]


def _compile(spec: GuidedSpec, index: TokenizerIndex) -> llguidance.LLMatcher:
    """A pristine matcher for ``spec`` (LRU cached; callers deep-copy it). Raises InvalidRequest."""
    key = (index, spec)  # the index object itself: an evicted index's id() could be reused
    with _lock:
        hit = _compiled.get(key)
        if hit is not None:
            _compiled.move_to_end(key)
            return hit
    matcher = llguidance.LLMatcher(index.ll, _grammar(spec), log_level=0)
    if matcher.is_error():
        raise InvalidRequest(f"invalid {spec.kind}: {_first_line(matcher.get_error())}")
    first = LlgMatcher(matcher.deep_copy(), index)
    first.fill_mask(torch.ones(index.vocab_size, dtype=torch.bool))
    if first.allowed == 0 and not matcher.is_accepting():
        raise InvalidRequest(f"this model's vocabulary cannot write any text matching the {spec.kind} "
                             "(no token can start it)")
    with _lock:
        _compiled[key] = matcher
        while len(_compiled) > COMPILED_CACHE_SIZE:
            _compiled.popitem(last=False)
    return matcher


class LlgMatcher:
    """A :class:`GuidedMatcher` over one ``llguidance.LLMatcher`` (one per sequence; not thread-safe)."""

    def __init__(self, matcher: llguidance.LLMatcher, index: TokenizerIndex):
        self._m = matcher
        self._index = index
        self._bitmask = np.zeros(index.words, dtype=np.int32)
        self.allowed = 0
        """Non-EOS tokens the last ``fill_mask`` allowed."""

    def fill_mask(self, mask: torch.Tensor) -> None:
        """Set ``mask[t] = False`` (bool ``[vocab_size]``, any device) for every token the grammar forbids next.

        A dead end (no token can continue and the text cannot end: a vocabulary without the needed
        characters, or a matcher in error) leaves only EOS allowed, so the sequence ends instead of sampling
        from an empty distribution.
        """
        idx = self._index
        self._m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: idx.vocab_size].astype(bool)
        bits &= ~idx.never
        eos = [i for i in idx.eos_token_ids if i < idx.vocab_size]
        self.allowed = int(bits.sum()) - int(bits[eos].sum())
        if self.allowed == 0:
            bits[eos] = True
        if mask.device.type == "cpu" and mask.is_contiguous():
            m = mask.numpy()
            np.logical_and(m, bits, out=m)
        else:
            mask &= torch.from_numpy(bits).to(mask.device)

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and the matcher stays in error: only EOS allowed next) if refused."""
        return bool(self._m.consume_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once the grammar has ended (an accepting end with nothing more allowed, or EOS accepted)."""
        return bool(self._m.is_stopped()) and not self._m.is_error()

    def is_accepting(self) -> bool:
        """True when the text so far is a complete match (EOS allowed now)."""
        return bool(self._m.is_accepting())

    def error(self) -> str | None:
        """Why the matcher refused a token, or None."""
        return self._m.get_error() if self._m.is_error() else None


def make_matcher(spec: GuidedSpec, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None) -> LlgMatcher:
    """A fresh matcher for one sequence.

    Args:
        spec: the constraint.
        tokenizer: ``splitserve.model.tokenizer.Tokenizer`` (``.hf`` is used; its index is built once).
        vocab_size: the model's vocabulary (rows of the LM head, tokens; may exceed the tokenizer's).
        eos_token_ids: ids that end a sequence (default ``tokenizer.eos_token_ids``; pass the model's).

    Raises:
        InvalidRequest: malformed spec (bad JSON, bad regex, unknown grammar rule, unsupported schema
            keyword), or one this vocabulary cannot start to write.
    """
    index = tokenizer_index(tokenizer, vocab_size, eos_token_ids)
    return LlgMatcher(_compile(spec, index).deep_copy(), index)
