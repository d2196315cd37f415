"""relpos against CTranslate2 on the same language model:
``python benchmarks/ct2_decode.py [options]`` runs :mod:`relpos.bench.ct2_decode` (the same as
``python -m relpos.bench.ct2_decode``)."""

import sys

from relpos.bench.ct2_decode import main

if __name__ == "__main__":
    sys.exit(main())
