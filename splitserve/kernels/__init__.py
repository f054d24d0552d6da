"""splitserve's own CPU kernels (C++, ``cpu_kernels.cpp``, built by :mod:`splitserve.kernels.build` with torch's
extension builder): the packed GEMM of the projections (:mod:`splitserve.kernels.cpu_gemm`) and decode attention
read in place from the paged KV cache (:mod:`splitserve.kernels.paged_decode`)."""
