"""Benchmark workloads: lists of requests (prompt token ids, output length, class), seeded.

Prompts are token ids drawn from ``vocab`` (ordinary text tokens of the served tokenizer) and are
sent as token-id prompts, so the prompt length is exact.

* ``synthetic_mixed``: interactive requests (short prompt, long output) with long "document"
  prompts (short output) landing among them at evenly spaced positions.
* ``synthetic_fixed``: every request the same prompt and output length (cross-checks).
* ``mooncake``: replay of the Mooncake trace (JSONL with ``hash_ids``). Each hash id becomes one
  fixed block of tokens, so requests with equal ``hash_ids`` prefixes share real token prefixes.
* ``azure``: replay of the Azure LLM inference trace (CSV, no prefix information).

Trace lengths are divided by ``input_scale`` / ``output_scale`` (the 512-token hash block by
``input_scale`` too, so sharing is kept) and times multiplied by ``time_scale``; the factors are
kept in ``Workload.info`` and printed with every result.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        index: position in the workload.
        prompt_token_ids: the prompt, as token ids.
        max_tokens: output tokens requested (sent with ``ignore_eos``, so exactly this many).
        kind: request class, e.g. "interactive", "document", "trace".
    """

    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str


@dataclass
class Workload:
    """Requests plus trace arrival times (None: use an arrival process) and descriptive info."""

    name: str
    requests: list[RequestSpec]
    arrivals_s: list[float] | None = None
    info: dict = field(default_factory=dict)


def _check_vocab(vocab: list[int]) -> np.ndarray:
    if len(vocab) < 2:
        raise ValueError("vocab must hold at least two token ids")
    return np.asarray(vocab, dtype=np.int64)


def _random_prompt(rng: np.random.Generator, pool: np.ndarray, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in pool[rng.integers(0, len(pool), size=n)])


def synthetic_mixed(
    vocab: list[int], n: int, seed: int, *, document_every: int = 6, warm_interactive: int = 8,
    interactive_prompt: tuple[int, int] = (32, 128), interactive_output: tuple[int, int] = (128, 192),
    document_prompt: tuple[int, int] = (1024, 1536), document_output: tuple[int, int] = (8, 16),
) -> Workload:
    """Interactive streams with long documents landing on them.

    The first ``warm_interactive`` requests are interactive (so streams are decoding when the first
    document arrives); after that every ``document_every``-th request is a document. Lengths are
    uniform in the given inclusive ranges.

    Raises:
        ValueError: n < 1, document_every < 1 or an empty range.
    """
    if n < 1 or document_every < 1:
        raise ValueError(f"need n >= 1 and document_every >= 1, got n={n}, document_every={document_every}")
    for lo, hi in (interactive_prompt, interactive_output, document_prompt, document_output):
        if not 1 <= lo <= hi:
            raise ValueError(f"bad length range ({lo}, {hi})")
    pool, rng = _check_vocab(vocab), np.random.default_rng(seed)
    requests = []
    for i in range(n):
        doc = i >= warm_interactive and (i - warm_interactive) % document_every == 0
        p_lo, p_hi = document_prompt if doc else interactive_prompt
        o_lo, o_hi = document_output if doc else interactive_output
        plen, olen = int(rng.integers(p_lo, p_hi + 1)), int(rng.integers(o_lo, o_hi + 1))
        requests.append(RequestSpec(i, _random_prompt(rng, pool, plen), olen, "document" if doc else "interactive"))
    info = {"type": "synthetic-mixed", "seed": seed, "requests": n, "documents": sum(r.kind == "document" for r in requests),
            "document_every": document_every, "warm_interactive": warm_interactive,
            "interactive_prompt": list(interactive_prompt), "interactive_output": list(interactive_output),
            "document_prompt": list(document_prompt), "document_output": list(document_output)}
    return Workload("synthetic-mixed", requests, None, info)


def synthetic_fixed(vocab: list[int], n: int, seed: int, prompt_tokens: int, output_tokens: int) -> Workload:
    """``n`` requests of exactly ``prompt_tokens`` random tokens and ``output_tokens`` outputs.

    Raises:
        ValueError: a non-positive size.
    """
    if n < 1 or prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("n, prompt_tokens and output_tokens must be >= 1")
    pool, rng = _check_vocab(vocab), np.random.default_rng(seed)
    requests = [RequestSpec(i, _random_prompt(rng, pool, prompt_tokens), output_tokens, "fixed") for i in range(n)]
    info = {"type": "synthetic-fixed", "seed": seed, "requests": n, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    return Workload("synthetic-fixed", requests, None, info)


def _scaled(value: int, scale: float) -> int:
    return max(1, int(round(value / scale)))


def _fit(plen: int, olen: int, max_model_len: int) -> tuple[int, int, bool]:
    """Shorten the prompt (then the output) so prompt + output fits the context; returns (plen, olen, truncated)."""
    if plen + olen <= max_model_len:
        return plen, olen, False
    olen = min(olen, max_model_len // 4)
    return min(plen, max_model_len - olen), olen, True


def fit_to_context(workload: Workload, max_model_len: int) -> tuple[Workload, int]:
    """``workload`` with every request cut to fit ``max_model_len`` tokens (prompt + output, as :func:`_fit`:
    the prompt keeps its first tokens); returns (workload, number of requests cut). Trace workloads are
    already fitted when built; this fits the synthetic ones to a small model's context.

    Raises:
        ValueError: ``max_model_len`` < 2 (no room for one prompt and one output token).
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    requests, cut = [], 0
    for r in workload.requests:
        plen, olen, truncated = _fit(len(r.prompt_token_ids), r.max_tokens, max_model_len)
        requests.append(RequestSpec(r.index, r.prompt_token_ids[:plen], olen, r.kind) if truncated else r)
        cut += truncated
    if not cut:
        return workload, 0
    info = {**workload.info, "truncated_to_context": cut, "max_model_len": max_model_len, **_length_info(requests)}
    return Workload(workload.name, requests, workload.arrivals_s, info), cut


def mooncake(
    path: str | Path, vocab: list[int], seed: int, *, input_scale: float = 32.0, output_scale: float = 1.0,
    time_scale: float = 1.0, max_requests: int | None = None, start: int = 0, max_model_len: int = 4096,
) -> Workload:
    """Replay the Mooncake trace: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    Hash id ``h`` maps to ``round(512 / input_scale)`` tokens drawn from a generator seeded with
    ``(seed, h)``; a prompt is its blocks concatenated and cut to the scaled input length (extra
    tokens, if the length exceeds the blocks, are unique to the request).

    Raises:
        FileNotFoundError, ValueError: missing file, bad scale, malformed lines.
    """
    from splitserve.bench.arrivals import from_timestamps

    if input_scale <= 0 or output_scale <= 0:
        raise ValueError("input_scale and output_scale must be > 0")
    pool = _check_vocab(vocab)
    block_len = max(1, int(round(MOONCAKE_BLOCK_TOKENS / input_scale)))
    blocks: dict[int, tuple[int, ...]] = {}

    def block(h: int) -> tuple[int, ...]:
        if h not in blocks:
            blocks[h] = _random_prompt(np.random.default_rng([seed, h]), pool, block_len)
        return blocks[h]

    rows = _read_jsonl(Path(path), start, max_requests)
    requests, times, seen, reused, total_blocks, truncated = [], [], set(), 0, 0, 0
    for i, row in enumerate(rows):
        try:
            ts, ilen, olen, hash_ids = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), list(row["hash_ids"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: line {start + i + 1} is not a Mooncake record: {e}") from None
        plen, out, cut = _fit(_scaled(ilen, input_scale), _scaled(olen, output_scale), max_model_len)
        truncated += cut
        tokens: list[int] = []
        for h in hash_ids:
            if len(tokens) >= plen:
                break
            tokens += block(h)
            total_blocks += 1
            reused += h in seen
            seen.add(h)
        if len(tokens) < plen:
            tokens += _random_prompt(np.random.default_rng([seed, 1 << 40, start + i]), pool, plen - len(tokens))
        requests.append(RequestSpec(i, tuple(tokens[:plen]), out, "trace"))
        times.append(ts / 1000.0)
    info = {"type": "mooncake", "file": str(path), "seed": seed, "requests": len(requests), "start": start,
            "input_scale": input_scale, "output_scale": output_scale, "time_scale": time_scale,
            "block_tokens": block_len, "reused_block_fraction": round(reused / total_blocks, 4) if total_blocks else 0.0,
            "truncated_to_context": truncated, **_length_info(requests)}
    return Workload("mooncake", requests, from_timestamps(times, time_scale), info)


def azure(
    path: str | Path, vocab: list[int], seed: int, *, input_scale: float = 4.0, output_scale: float = 1.0,
    time_scale: float = 1.0, max_requests: int | None = None, start: int = 0, max_model_len: int = 4096,
) -> Workload:
    """Replay the Azure LLM inference trace CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``).

    Prompts are random (the trace has no prefix information), one generator per request.

    Raises:
        FileNotFoundError, ValueError: missing file, bad scale, malformed rows.
    """
    from splitserve.bench.arrivals import from_timestamps

    if input_scale <= 0 or output_scale <= 0:
        raise ValueError("input_scale and output_scale must be > 0")
    pool = _check_vocab(vocab)
    requests, times, truncated = [], [], 0
    with Path(path).open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if max_requests is not None and len(requests) >= max_requests:
                break
            try:
                ts = _parse_time(row["TIMESTAMP"])
                ilen, olen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: row {i + 2} is not an Azure trace record: {e}") from None
            plen, out, cut = _fit(_scaled(ilen, input_scale), _scaled(olen, output_scale), max_model_len)
            truncated += cut
            prompt = _random_prompt(np.random.default_rng([seed, i]), pool, plen)
            requests.append(RequestSpec(len(requests), prompt, out, "trace"))
            times.append(ts)
    info = {"type": "azure", "file": str(path), "seed": seed, "requests": len(requests), "start": start,
            "input_scale": input_scale, "output_scale": output_scale, "time_scale": time_scale,
            "truncated_to_context": truncated, **_length_info(requests)}
    return Workload("azure", requests, from_timestamps(times, time_scale), info)


def _parse_time(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (7 fractional digits) -> POSIX seconds."""
    whole, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float(f"0.{frac}") if frac else 0.0)


def _read_jsonl(path: Path, start: int, max_requests: int | None) -> list[dict]:
    rows = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            if max_requests is not None and len(rows) >= max_requests:
                break
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {e}") from None
    return rows


def _length_info(requests: list[RequestSpec]) -> dict:
    if not requests:
        return {}
    p = np.array([len(r.prompt_token_ids) for r in requests])
    o = np.array([r.max_tokens for r in requests])
    return {"prompt_tokens_mean": round(float(p.mean()), 1), "prompt_tokens_p50": float(np.percentile(p, 50)),
            "prompt_tokens_max": int(p.max()), "output_tokens_mean": round(float(o.mean()), 1), "output_tokens_max": int(o.max())}
