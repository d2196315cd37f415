"""CUDA check of the fused and triton backends: ``python benchmarks/cuda_check.py [options]``
runs :mod:`relpos.bench.cuda_check` (the same as ``python -m relpos.bench.cuda_check``)."""

import sys

from relpos.bench.cuda_check import main

if __name__ == "__main__":
    sys.exit(main())
