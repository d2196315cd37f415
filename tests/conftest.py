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



# Signs of life: before its first result the suite starts its workers (each imports torch and
# collects every test) and may compile the native kernels, minutes of silence on a small
# machine; the controller (not a pytest-xdist worker) says what it is doing, a line a phase.
_LIFE: dict = {}
_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _say(line: str) -> None:
    reporter = _LIFE["config"].pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(f"relpos tests: {line}")


def _kernels_built() -> bool | None:
    """Whether the native kernels are built in the suite's cache (None: cannot tell)."""
    try:
        from relpos.ops.native import build

        return None if build.disabled() else build.status().built
    except Exception:
        return None


def pytest_configure(config):
    _LIFE["config"] = config
    if not _WORKER and config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistLife(), "relpos-signs-of-life")


def pytest_sessionstart(session):
    import time

    from relpos._timings import FIRST_COMPILE_SECONDS, TEST_SUITE_SECONDS, duration_text

    if _WORKER:
        return
    _LIFE.update(start=time.monotonic(), checked=time.monotonic(), built=_kernels_built())
    workers = getattr(session.config.option, "numprocesses", None)
    _say(f"the whole suite takes {duration_text(max(TEST_SUITE_SECONDS))} on 2 cores; "
         + (f"starting {workers} worker{'s' if workers != 1 else ''}, each importing torch "
            "and collecting the tests before the first result" if workers
            else "collecting the tests"))
    if _LIFE["built"] is False:
        _say("the native kernels are not built in build/relpos-cache: the first test that "
             f"needs them compiles them, {duration_text(FIRST_COMPILE_SECONDS)} on 2 cores, "
             "once (the tests that need them wait meanwhile)")


def _collected(count: int) -> None:
    import time

    if "collected" not in _LIFE and not _LIFE["config"].option.collectonly:
        _LIFE["collected"] = True
        _say(f"collected {count} tests in {time.monotonic() - _LIFE['start']:.0f} s; running")


def pytest_collection_finish(session):
    if not _WORKER and not getattr(session.config.option, "numprocesses", None):
        _collected(len(session.items))


def pytest_runtest_logreport(report):
    import time

    if not _WORKER and _LIFE.get("built") is False and time.monotonic() - _LIFE["checked"] > 10:
        _LIFE["checked"] = time.monotonic()
        if _kernels_built():
            _LIFE["built"] = True
            _say(f"the native kernels are built ({time.monotonic() - _LIFE['start']:.0f} s "
                 "after the start)")


class _XdistLife:
    def pytest_xdist_node_collection_finished(self, node, ids):
        _collected(len(ids))
