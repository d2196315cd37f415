"""generate_packed against generate, end to end: ``python benchmarks/generate_packed.py
[options]`` runs :mod:`relpos.bench.generate_packed` (the same as ``python -m
relpos.bench.generate_packed``)."""

import sys

from relpos.bench.generate_packed import main

if __name__ == "__main__":
    sys.exit(main())
