import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Small CI machines: one thread per pytest-xdist worker, at most two otherwise.
_threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads())
torch.set_num_threads(_threads)
