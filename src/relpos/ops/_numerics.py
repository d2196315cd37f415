"""The numerics choices every backend shares: the accumulation dtype and the exponential.

Shape legend: none (elementwise).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["accumulation_dtype", "exp_"]

_LOG2_E = 1.4426950408889634


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and softmax statistics are kept in: float32 for half precision
    (``float16``, ``bfloat16``), the input dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def exp_(x: Tensor) -> Tensor:
    """``x.exp_()``, computed as ``2 ** (x * log2(e))``: the same numbers to within the
    rounding of one product (absolute error in a probability below one ulp of 1), and fast
    for every input.

    On CPU, ``torch.exp`` goes through MKL's vector math, whose underflow handling makes each
    element below about -87 (float32; -708 in float64), ``-inf`` included, cost 10 to 80
    times a normal one. Masked scores are exactly such elements: in the flash_regions backend's
    band three quarters of a tile's scores are ``-inf`` at K = 16. ``torch.exp2`` has no such path.
    """
    return x.mul_(_LOG2_E).exp2_()
