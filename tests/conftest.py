import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Deterministic, quiet runs on small CI machines.
torch.set_num_threads(min(2, torch.get_num_threads()))
