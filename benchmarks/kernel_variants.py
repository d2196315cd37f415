"""The native kernels' portable variants against this CPU's build: ``python
benchmarks/kernel_variants.py [options]`` runs :mod:`relpos.bench.kernel_variants` (the same
as ``python -m relpos.bench.kernel_variants``)."""

import sys

from relpos.bench.kernel_variants import main

if __name__ == "__main__":
    sys.exit(main())
