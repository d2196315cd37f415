"""relpos: exact clipped relative position attention (Shaw, Uszkoreit & Vaswani, 2018).

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
E model dim, K clip distance (``max_distance``), R = 2K + 1 table rows.

The public names load on first use (PEP 562), so ``import relpos`` and the command line's
``relpos --help`` do not import torch. The first use of any name below loads the core
(positions, functional, ops, modules, cache, tables, versioning); the lab (``relpos.models``,
``relpos.training``, ``relpos.export``) and the benchmark harness (``relpos.bench``) load only
when they are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relpos._deprecated import install_moved_modules
from relpos._lazy import lazy_exports
from relpos._version import __version__

install_moved_modules()  # old module paths (relpos.tasks, ...) warn and lead to the new ones

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "KVCache": "relpos.cache",
    "LayerCache": "relpos.cache",
    "PackedKVCache": "relpos.cache",
    "PackedLayerCache": "relpos.cache",
    "RelativeMultiheadAttention": "relpos.modules",
    "RelativeStateError": "relpos.versioning",
    "RelativeTransformerDecoderLayer": "relpos.modules",
    "RelativeTransformerEncoderLayer": "relpos.modules",
    "available_backends": "relpos.functional",
    "clip_relative_position": "relpos.positions",
    "cu_seqlens_from_lengths": "relpos.varlen",
    "explain_backends": "relpos.functional",
    "explain_backends_varlen": "relpos.varlen",
    "load_state_dict_resized": "relpos.tables",
    "pack": "relpos.varlen",
    "relative_attention": "relpos.functional",
    "relative_attention_varlen": "relpos.varlen",
    "relative_attention_with_weights": "relpos.functional",
    "relative_position_index": "relpos.positions",
    "resize_relative_table": "relpos.tables",
    "select_backend": "relpos.functional",
    "select_backend_varlen": "relpos.varlen",
    "unpack": "relpos.varlen",
    "why_not_fused": "relpos.functional",
}
# Subpackages reachable as attributes (``relpos.models.ModelConfig``).
_SUBMODULES = ("models",)

__all__ = [
    "KVCache",
    "LayerCache",
    "PackedKVCache",
    "PackedLayerCache",
    "RelativeMultiheadAttention",
    "RelativeStateError",
    "RelativeTransformerDecoderLayer",
    "RelativeTransformerEncoderLayer",
    "__version__",
    "available_backends",
    "clip_relative_position",
    "cu_seqlens_from_lengths",
    "explain_backends",
    "explain_backends_varlen",
    "load_state_dict_resized",
    "models",
    "pack",
    "relative_attention",
    "relative_attention_varlen",
    "relative_attention_with_weights",
    "relative_position_index",
    "resize_relative_table",
    "select_backend",
    "select_backend_varlen",
    "unpack",
    "why_not_fused",
]
assert set(__all__) == {"__version__", *_EXPORTS, *_SUBMODULES}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)


if TYPE_CHECKING:  # static analysers see the eager imports
    from relpos import models
    from relpos.cache import KVCache, LayerCache, PackedKVCache, PackedLayerCache
    from relpos.functional import (
        available_backends,
        explain_backends,
        relative_attention,
        relative_attention_with_weights,
        select_backend,
        why_not_fused,
    )
    from relpos.modules import (
        RelativeMultiheadAttention,
        RelativeTransformerDecoderLayer,
        RelativeTransformerEncoderLayer,
    )
    from relpos.positions import clip_relative_position, relative_position_index
    from relpos.tables import load_state_dict_resized, resize_relative_table
    from relpos.varlen import (
        cu_seqlens_from_lengths,
        explain_backends_varlen,
        pack,
        relative_attention_varlen,
        select_backend_varlen,
        unpack,
    )
    from relpos.versioning import RelativeStateError
