"""Benchmark client and configuration comparison: ``splitserve bench`` / ``splitserve bench compare``.

Modules: ``workloads`` (synthetic mixed/fixed, Mooncake and Azure trace replay), ``arrivals``
(Poisson, gamma, trace times; fixed concurrency lives in the client), ``client`` (streams
``/v1/completions`` and times every chunk), ``metrics`` (percentiles, TPOT, goodput), ``report``
and ``plots`` (JSON, Markdown, PNG), ``compare`` (starts each configuration in turn),
``efficiency`` (decode vs memory-bandwidth bound, prefill vs matmul peak), ``cli`` (flags).
"""
