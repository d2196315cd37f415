"""A 6-layer relpos encoder against the same ``nn.TransformerEncoder`` (eval, padded,
dropout): ``python benchmarks/encoder_variants.py [options]`` runs
:mod:`relpos.bench.encoder_variants` (the same as ``python -m relpos.bench.encoder_variants``)."""

import sys

from relpos.bench.encoder_variants import main

if __name__ == "__main__":
    sys.exit(main())
