"""Packed variable-length batches against padded ones: ``python benchmarks/varlen.py
[options]`` runs :mod:`relpos.bench.varlen` (the same as ``python -m relpos.bench.varlen``)."""

import sys

from relpos.bench.varlen import main

if __name__ == "__main__":
    sys.exit(main())
