"""w2v-BERT 2.0 through relpos against stock Hugging Face attention:
``python benchmarks/w2v_bert.py [options]`` runs :mod:`relpos.bench.w2v_bert` (the same as
``python -m relpos.bench.w2v_bert``)."""

import sys

from relpos.bench.w2v_bert import main

if __name__ == "__main__":
    sys.exit(main())
