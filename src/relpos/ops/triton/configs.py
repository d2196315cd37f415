"""Block sizes of the Triton kernels: one fixed table, no run-time tuning.

Every entry is compiled ahead of time for sm_80 and sm_90 (``tests/ops/test_triton_aot.py``)
(shared memory within the architecture's limit, no register spills), so a configuration that
runs on a GPU is one that was checked. Each entry is the largest tile of a short list (starting
from FlashAttention-2's Triton tutorial: 128 x 64 forward tiles in half precision) that compiles
for sm_80 and sm_90 without spills, with every feature on: the band's gathers and bucket
stores keep a tile's indices and 64-bit addresses live, so the tiles are smaller than plain
flash attention's, and float32 operands in IEEE precision (FMA, not tensor cores) smaller
still.
GPU speed is unmeasured, so none is tuned for speed.

Importing this module does not import Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK_R", "CONFIGS", "HEAD_DIMS", "KERNELS", "KernelConfig", "block_dim", "config",
           "dtype_class"]

KERNELS = ("forward", "backward_dkdv", "backward_dq")
HEAD_DIMS = (32, 64, 128)
"""The padded head dims (``BLOCK_D``) there are configurations for: D up to 128."""

BLOCK_R = 32
"""Table rows per step of the forward's closing ``Pb @ aV`` product."""


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


_K = KernelConfig
_TABLE = {
    # (kernel, dtype class): (config for BLOCK_D 32 and 64, config for BLOCK_D 128)
    ("forward", "half"): (_K(64, 32, 8, 2), _K(32, 32, 4, 2)),
    ("forward", "float32"): (_K(32, 32, 8, 2), _K(32, 16, 8, 2)),
    ("backward_dkdv", "half"): (_K(32, 64, 4, 2), _K(32, 64, 8, 2)),
    ("backward_dkdv", "float32"): (_K(16, 32, 8, 2), _K(16, 16, 8, 2)),
    ("backward_dq", "half"): (_K(32, 32, 8, 2), _K(32, 32, 8, 2)),
    ("backward_dq", "float32"): (_K(32, 16, 8, 2), _K(32, 32, 8, 2)),
}


def _table() -> dict[tuple[str, int, str], KernelConfig]:
    return {(kernel, d, cls): pair[d == 128]
            for (kernel, cls), pair in _TABLE.items() for d in HEAD_DIMS}


CONFIGS: dict[tuple[str, int, str], KernelConfig] = _table()
"""``(kernel, BLOCK_D, "half" | "float32") -> KernelConfig``: every configuration a call can
use on a GPU."""


def block_dim(dim: int) -> int:
    """A head dim rounded up to a power of two, at least 32 (``tl.dot`` takes 16; one
    configuration fewer to check)."""
    return max(32, 1 << max(dim - 1, 0).bit_length())


def dtype_class(dtype: torch.dtype) -> str:
    return "half" if dtype in (torch.float16, torch.bfloat16) else "float32"


def config(kernel: str, dim: int, dtype: torch.dtype) -> KernelConfig:
    """The configuration of ``kernel`` for the larger head dim ``dim`` of a call (float64,
    served under the interpreter only, takes the float32 entries)."""
    return CONFIGS[kernel, block_dim(dim), dtype_class(dtype)]
