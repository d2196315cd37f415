import importlib.util
import os
import sys

import pytest
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



@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernels turned off (RELPOS_NATIVE=0): what auto-selection and the PyTorch
    backends do without them (no compiler, or turned off by the user)."""
    monkeypatch.setenv("RELPOS_NATIVE", "0")


# The triton backend runs on CPU tensors under Triton's interpreter, which is chosen when the
# kernels are first imported: set it here, before any test module loads them (conftest runs
# first in the main process and in every pytest-xdist worker).
os.environ["TRITON_INTERPRET"] = "1"

_TRITON_SKIPS = {
    # The interpreter runs each kernel program in Python (~0.05 s a program): these tests make
    # hundreds of calls per backend. tests/ops/test_triton.py checks the same for triton.
    "tests/ops/test_nonfinite.py::test_nan_in_an_attended_key_or_value_gives_nan":
        "hundreds of calls under the interpreter; tests/ops/test_triton.py checks NaN for triton",
    "tests/modules/test_windows.py::test_cached_steps_equal_one_full_causal_pass":
        "hundreds of calls under the interpreter; tests/test_cache.py checks triton's steps",
    # Refused by design (a reason names it; tests/ops/test_triton.py checks the refusal).
    "tests/test_functional.py::test_fully_masked_rows_give_zeros[bool_mask-triton]":
        "the triton backend serves no dense attn_mask",
    "tests/test_functional.py::test_fully_masked_rows_give_zeros[float_mask-triton]":
        "the triton backend serves no dense attn_mask",
}


def pytest_collection_modifyitems(config, items):
    # Without triton (not a CI machine: CI installs it with the dev extra, and fails without it)
    # the backend refuses every call; skip its cases instead of failing them.
    missing = importlib.util.find_spec("triton") is None and not os.environ.get("CI")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("implementation") != "triton":
            continue
        if missing:
            item.add_marker(pytest.mark.skip(reason="triton is not installed"))
            continue
        for prefix, reason in _TRITON_SKIPS.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=reason))
