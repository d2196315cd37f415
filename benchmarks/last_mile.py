"""The native kernels' targets checked against benchmark reports: ``python
benchmarks/last_mile.py [options]`` runs :mod:`relpos.bench.last_mile` (the same as ``python -m
relpos.bench.last_mile``)."""

import sys

from relpos.bench.last_mile import main

if __name__ == "__main__":
    sys.exit(main())
