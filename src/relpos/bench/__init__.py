"""The benchmark harness behind ``relpos bench``: timings and peak memory against plain
``F.scaled_dot_product_attention`` measured in the same run, and reports with the hardware,
versions, date and command.

Modules:
    :mod:`relpos.bench.attention`: whole-sequence attention, forward and forward + backward,
        every backend (``relpos bench``).
    :mod:`relpos.bench.decode`: one KV-cache decode step (``relpos bench --decode``).
    :mod:`relpos.bench.common`: interleaved timing rounds and medians, report header and
        files (CSV, markdown).
    :mod:`relpos.bench.memory`: peak memory of one call in a fresh subprocess.

Benchmarks are not tests. The names below load on first use (PEP 562): importing
``relpos.bench`` or :mod:`relpos.bench.common` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "Config": "relpos.bench.attention",
    "DecodeResult": "relpos.bench.decode",
    "Result": "relpos.bench.attention",
    "measure_step": "relpos.bench.decode",
    "run_attention": "relpos.bench.attention",
    "run_decode": "relpos.bench.decode",
}

__all__ = ["Config", "DecodeResult", "Result", "measure_step", "run_attention", "run_decode"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'relpos.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from relpos.bench.attention import Config, Result, run_attention
    from relpos.bench.decode import DecodeResult, measure_step, run_decode
