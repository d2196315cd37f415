import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Small CI machines: one thread per pytest-xdist worker, at most two otherwise.
_threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads())
torch.set_num_threads(_threads)

# The native kernels compile into the repository's own build/ folder (ignored by git), once for
# all pytest-xdist workers (a file lock), so the suite reads nothing outside the repository.
os.environ["RELPOS_CACHE_DIR"] = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "relpos-cache"
)


import pytest  # noqa: E402


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernels turned off (RELPOS_NATIVE=0): what auto-selection and the PyTorch
    backends do without them (no compiler, or turned off by the user)."""
    monkeypatch.setenv("RELPOS_NATIVE", "0")
