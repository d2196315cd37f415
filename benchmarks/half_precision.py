"""relpos in 16-bit against the same call in float32: ``python benchmarks/half_precision.py
[options]`` runs :mod:`relpos.bench.half_precision` (the same as ``python -m
relpos.bench.half_precision``)."""

import sys

from relpos.bench.half_precision import main

if __name__ == "__main__":
    sys.exit(main())
