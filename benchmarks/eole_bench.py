"""Stock eole against eole patched by relpos: ``python benchmarks/eole_bench.py [options]``
runs :mod:`relpos.bench.eole` (the same as ``python -m relpos.bench.eole``)."""

import sys

from relpos.bench.eole import main

if __name__ == "__main__":
    sys.exit(main())
