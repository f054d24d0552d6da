"""`splitserve bench efficiency`'s pieces (splitserve/bench/efficiency.py): the bandwidth probes and the table."""

from __future__ import annotations

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
