"""splitserve's own CPU kernels (C++ built with torch's extension builder): see :mod:`splitserve.kernels.cpu_gemm`."""
