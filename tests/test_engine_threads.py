"""Threads per phase: small decode steps use --decode-threads, prefill / mixed / large decode steps --torch-threads."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from splitserve.engine.args import add_engine_args
from splitserve.engine.async_engine import set_torch_threads
from splitserve.engine.config import EngineConfig
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


def set_threads(n: int, pinned: set[int] | None, owns_machine: bool) -> int:
    before = torch.get_num_threads()
    try:
        got = set_torch_threads(n, pinned, owns_machine=owns_machine)
        assert torch.get_num_threads() == got
        return got
    finally:
        torch.set_num_threads(before)


def test_torch_threads_auto_follows_pinned_cpus_then_the_machine():
    allowed = len(os.sched_getaffinity(0))
    assert set_threads(3, None, False) == 3 and set_threads(3, {0}, True) == 3  # an explicit count wins
    assert set_threads(0, {0}, True) == 1 and set_threads(0, {0, 1}, False) == 2  # one per pinned CPU
    assert set_threads(0, None, True) == allowed  # colocated, unpinned: every CPU it may use
    assert set_threads(0, None, False) == 1  # a worker beside others, unpinned


def test_torch_threads_flag_defaults_to_auto():
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert ap.parse_args(["--model", "m"]).torch_threads == 0


class _LM:
    def __init__(self, dtype: str, packed: bool = False) -> None:
        self.config = type("Cfg", (), {"dtype": dtype})()
        self.model = type("Model", (), {"packed_for_cpu": packed})()


def test_decode_threads_auto_is_one_for_float32_on_torch_mm_and_all_otherwise():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert ModelRunner(_LM("float32"), torch.empty(0), 16, -1).threads_for(1, 1) == 1
        assert ModelRunner(_LM("float32", packed=True), torch.empty(0), 16, -1).threads_for(1, 1) == 2  # CPU GEMM kernel
        assert ModelRunner(_LM("bfloat16"), torch.empty(0), 16, -1).threads_for(1, 1) == 2
        assert ModelRunner(_LM("float16"), torch.empty(0), 16, -1).threads_for(4, 4) == 2
        assert ModelRunner(_LM("bfloat16"), torch.empty(0), 16, 1).threads_for(1, 1) == 1  # an explicit count wins
    finally:
        torch.set_num_threads(before)


def test_decode_threads_flag_defaults_to_auto_and_rejects_below_minus_one():
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert ap.parse_args(["--model", "m"]).decode_threads == -1
    with pytest.raises(ValueError, match="--decode-threads"):
        EngineConfig(decode_threads=-2)
