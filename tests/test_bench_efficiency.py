"""`splitserve bench efficiency`'s pieces (splitserve/bench/efficiency.py): the bandwidth probes and the table."""

from __future__ import annotations

import torch

from splitserve.bench.efficiency import format_rows, memcpy_bandwidth, read_bandwidth


def test_bandwidth_probes_return_bytes_per_second():
    assert read_bandwidth(1 << 20, repeat=2) > 1e6  # a 1 MiB sum: at least a megabyte a second
    assert memcpy_bandwidth(1 << 20, repeat=2) > 1e6


def test_table_reports_the_decode_read_rate_as_a_fraction_of_the_machines():
    row = {"threads": 2, "memcpy_GBps": 20.0, "matmul_GFLOPs": 100.0, "decode_batch": 1, "decode_context": 128,
           "decode_step_ms": 10.0, "decode_bound_ms": 5.0, "decode_bytes_MB": 100.0, "read_GBps": 25.0,
           "decode_read_fraction": 100e6 / 10e-3 / 25e9, "prefill_tokens": 512, "prefill_tok_s": 1000.0,
           "prefill_GFLOPs": 50.0}
    table = format_rows([row], "m")
    assert "decode reads at ÷ read" in table
    assert "| 2 | 20.0 | 10.0 (batch 1, ctx 128) | 5.0 (100 MB) | 2.0× | 25.0 | 40% | 1000 (512 tok) | 50.0 | 100.0 | 50% |" in table


def test_a_16_bit_table_reports_prefill_against_torchs_16_bit_peak_and_float32s():
    row = {"threads": 1, "dtype": "bfloat16", "memcpy_GBps": 10.0, "matmul_GFLOPs": 20.0, "matmul_fp32_GFLOPs": 80.0,
           "decode_batch": 1, "decode_context": 128, "decode_step_ms": 5.0, "decode_bound_ms": 5.0,
           "decode_bytes_MB": 50.0, "read_GBps": 12.5, "decode_read_fraction": 50e6 / 5e-3 / 12.5e9,
           "prefill_tokens": 512, "prefill_tok_s": 800.0, "prefill_GFLOPs": 40.0}
    table = format_rows([row], "m")
    assert "(m, bfloat16)" in table and "torch bfloat16 matmul peak" in table and "prefill ÷ float32 peak" in table
    assert table.splitlines()[-1].endswith("| 80% | 800 (512 tok) | 40.0 | 20.0 | 200% | 80.0 | 50% |")


def test_the_matmul_peak_of_a_16_bit_dtype_is_measured_in_it():
    from splitserve.bench.efficiency import matmul_peak

    assert matmul_peak(n=128, repeat=1, dtype=torch.bfloat16) > 1e6
