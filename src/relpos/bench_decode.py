"""Deprecated: the decode benchmark is :mod:`relpos.bench.decode` (``relpos bench --decode``).

Importing this module warns (:class:`DeprecationWarning`) and re-exports
:class:`~relpos.bench.decode.DecodeResult`, :func:`~relpos.bench.decode.measure_step` and
:func:`~relpos.bench.decode.run_decode`. Its command line (``python -m relpos.bench_decode``)
is ``relpos bench --decode`` now, with the same options (lists comma-separated).
"""

from __future__ import annotations

import warnings

from relpos.bench.decode import DecodeResult, measure_step, run_decode

__all__ = ["DecodeResult", "measure_step", "run_decode"]

warnings.warn(
    "relpos.bench_decode is deprecated; use relpos.bench.decode (or relpos bench --decode)",
    DeprecationWarning,
    stacklevel=2,
)
