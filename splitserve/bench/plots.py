"""PNG plots (matplotlib, Agg): TTFT and ITL CDFs per configuration, per-request timelines."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from splitserve.bench.client import RequestRecord

KIND_COLORS = {"interactive": "tab:blue", "document": "tab:red", "trace": "tab:green", "fixed": "tab:purple"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(series: dict[str, list[float]], title: str, xlabel: str, path: Path, log_x: bool = True) -> Path:
    """One empirical CDF line per name in ``series`` (values in ms); returns ``path``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        if not values:
            continue
        x = np.sort(np.asarray(values, dtype=float))
        y = np.arange(1, x.size + 1) / x.size
        ax.step(x, y, where="post", label=f"{name} (n={x.size}, p99={np.percentile(x, 99):.0f} ms)")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_ylim(0, 1.01)
    ax.axhline(0.99, color="grey", lw=0.6, ls=":")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(records: list[RequestRecord], title: str, path: Path) -> Path:
    """One row per request: thin line from send to first token (waiting for TTFT), thick line while
    streaming (first token to end), coloured by request class; failed requests are marked x."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, max(3.0, min(12.0, 0.06 * len(records) + 2))))
    seen = set()
    for r in records:
        color = KIND_COLORS.get(r.kind, "tab:gray")
        label = r.kind if r.kind not in seen else None
        seen.add(r.kind)
        if not r.ok:
            ax.plot([r.start_s], [r.index], "x", color="black")
            continue
        first = r.start_s + r.ttft_s
        ax.hlines(r.index, r.start_s, first, color=color, lw=1, alpha=0.6)
        ax.hlines(r.index, first, r.end_s, color=color, lw=3, label=label)
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("request")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title + "  (thin: waiting for first token, thick: streaming)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
