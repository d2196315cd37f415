"""Context parallelism: one sequence sharded over the ranks of a ``torch.distributed`` group.

Not imported by ``import relpos``: ``import relpos.distributed`` loads it. See
``docs/scaling.md`` for what exists, its communication and memory, and what is not built yet.
"""

from __future__ import annotations

from relpos.distributed.context_parallel import (
    LAYOUTS,
    MODES,
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)
from relpos.distributed.modules import context_parallel, is_context_parallel
from relpos.distributed.traffic import Traffic, TrafficCounter, count_traffic, traffic

__all__ = ["LAYOUTS", "MODES", "Traffic", "TrafficCounter", "context_parallel",
           "context_parallel_attention", "count_traffic", "is_context_parallel", "shard_sequence",
           "traffic", "unshard_sequence"]
