"""The three workloads of the peer comparison (issue 13), built with splitserve's bench workloads, and the table.

* ``single``: one stream at a time, short prompt, long output: decode tokens/s = 1000 / TPOT p50 (ms).
* ``conc16``: 48 requests at concurrency 16, 130 tokens in, 128 out: output tokens/s, ITL p50, TTFT p50.
* ``mixed``: 64 requests at concurrency 12, every 4th request after the first 8 a ~1,000-token document
  (960-1040 tokens in, 8-16 out; interactive: 32-128 in, 96-160 out): output tokens/s, TTFT p50, ITL p50/p99.

``quick=True`` shrinks every workload to a few short requests (a smoke test of the runner, not a measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.bench import workloads as wl


@dataclass(frozen=True)
class Spec:
    """A workload and how it is driven: ``concurrency`` requests in flight (closed loop)."""

    key: str
    title: str
    workload: wl.Workload
    concurrency: int


def build(vocab: list[int], seed: int = 0, quick: bool = False) -> list[Spec]:
    """The workloads, prompts drawn from ``vocab`` (plain token ids of the model's tokenizer)."""
    if quick:
        single = wl.synthetic_fixed(vocab, 1, seed, 32, 32)
        conc = wl.synthetic_fixed(vocab, 6, seed, 32, 16)
        mixed = wl.synthetic_mixed(vocab, 6, seed, document_every=2, warm_interactive=2, interactive_prompt=(16, 32),
                                   interactive_output=(12, 16), document_prompt=(200, 240), document_output=(4, 6))
        return [Spec("single", "single-stream decode (quick)", single, 1), Spec("conc16", "6 requests at concurrency 3 (quick)", conc, 3),
                Spec("mixed", "mixed load at concurrency 3 (quick)", mixed, 3)]
    single = wl.synthetic_fixed(vocab, 3, seed, 32, 256)
    conc = wl.synthetic_fixed(vocab, 48, seed, 130, 128)
    mixed = wl.synthetic_mixed(vocab, 64, seed, document_every=4, warm_interactive=8, interactive_prompt=(32, 128),
                               interactive_output=(96, 160), document_prompt=(960, 1040), document_output=(8, 16))
    return [Spec("single", "single-stream decode (3 requests, 32 in, 256 out)", single, 1),
            Spec("conc16", "48 requests at concurrency 16, 130 in, 128 out", conc, 16),
            Spec("mixed", "mixed load, 64 requests at concurrency 12, every 4th a ~1,000-token document", mixed, 12)]


# (row label, workload key, metric); metric "decode_tps" = 1000 / TPOT p50
ROWS = [
    ("single-stream decode, tokens/s", "single", "decode_tps"),
    ("conc 16: output tokens/s", "conc16", "output_tokens_per_s"), ("conc 16: ITL p50 (ms)", "conc16", "itl_p50"),
    ("conc 16: TTFT p50 (ms)", "conc16", "ttft_p50"),
    ("mixed: output tokens/s", "mixed", "output_tokens_per_s"), ("mixed: TTFT p50 (ms)", "mixed", "ttft_p50"),
    ("mixed: ITL p50 (ms)", "mixed", "itl_p50"), ("mixed: ITL p99 (ms)", "mixed", "itl_p99"),
]


def metrics(summary: dict) -> dict[str, float | None]:
    """The table's numbers from a ``splitserve.bench.metrics.summarize`` summary."""
    tpot = summary["tpot_ms"]["p50"]
    return {"decode_tps": 1000.0 / tpot if tpot else None, "output_tokens_per_s": summary["output_tokens_per_s"],
            "itl_p50": summary["itl_ms"]["p50"], "itl_p99": summary["itl_ms"]["p99"], "ttft_p50": summary["ttft_ms"]["p50"],
            "errors": summary["errors"]}


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def table(results: dict[str, dict[str, dict]], engines: list[str]) -> str:
    """Markdown: one column per engine, then each splitserve engine's ratio to vLLM and to llama.cpp.

    ``results[engine][workload key]`` is :func:`metrics`' dict (absent: not run)."""
    def value(engine: str, key: str, metric: str) -> float | None:
        return results.get(engine, {}).get(key, {}).get(metric)

    peers = [p for p in ("vllm", "llama.cpp") if p in engines]
    ours = [e for e in engines if e.startswith("splitserve")]
    ratio_cols = [(o, p) for p in peers for o in ours]
    head = ["", *engines, *(f"{o} ÷ {p}" for o, p in ratio_cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, metric in ROWS:
        cells = [_fmt(value(e, key, metric)) for e in engines]
        for o, p in ratio_cols:
            a, b = value(o, key, metric), value(p, key, metric)
            cells.append("—" if a is None or not b else f"{a / b:.2f}×")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
