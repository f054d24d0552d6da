"""Threads per phase: small decode steps use --decode-threads, prefill / mixed / large decode steps --torch-threads."""

from __future__ import annotations

import torch

from splitserve.engine.runner import PARALLEL_DECODE_MIN_SEQS, ModelRunner


def runner(torch_threads: int, decode_threads: int) -> ModelRunner:
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        return ModelRunner(None, torch.empty(0), 16, decode_threads)
    finally:
        torch.set_num_threads(before)


def test_small_decode_steps_use_decode_threads():
    r = runner(2, 1)
    assert r.threads_for(1, 1) == 1 and r.threads_for(PARALLEL_DECODE_MIN_SEQS - 1, PARALLEL_DECODE_MIN_SEQS - 1) == 1
    assert r.threads_for(PARALLEL_DECODE_MIN_SEQS, PARALLEL_DECODE_MIN_SEQS) == 2  # large decode batch
    assert r.threads_for(128, 1) == 2 and r.threads_for(9, 3) == 2  # prefill, mixed step


def test_decode_threads_zero_or_above_torch_threads_means_torch_threads():
    assert runner(2, 0).threads_for(1, 1) == 2
    assert runner(1, 4).threads_for(1, 1) == 1
