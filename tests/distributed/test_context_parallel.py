"""Context parallelism (relpos.distributed): 2, 3 and 4 CPU ranks (gloo, 127.0.0.1) equal one
process to 1e-10, forward and backward, on every layout, clip distance, window, table kind
and key mask; the refusals; ranks that disagree on an option; shard/unshard round trips.

The ranks are subprocesses running ``_cp_worker.py``, each joined under a timeout and killed
after it: a test may fail, never hang.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_ranks
from relpos.distributed import context_parallel_attention, shard_sequence

WORKER = Path(__file__).with_name("_cp_worker.py")
TIMEOUT_S = 120.0


def _run_ranks(world: int) -> None:
    run_ranks(str(WORKER), world, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_equal_one_process(world: int) -> None:
    _run_ranks(world)


def test_ranks_that_disagree_raise_one_error() -> None:
    """Two ranks that differ in one option each (layout, mode, head_group, is_causal,
    max_distance, scale, table shapes, a table given on one rank only, dropout_p, gradients,
    arguments one rank refuses), in one pair of processes: every rank raises one ValueError
    naming the option and each rank's value, none hangs or aborts, and the group still
    computes right after."""
    run_ranks(str(WORKER), 2, "mismatch", timeout_s=90.0)


def _qkv(n: int = 4) -> torch.Tensor:
    return torch.randn(1, 1, n, 2, dtype=torch.float64)


def test_unknown_mode_is_refused() -> None:
    x = _qkv()
    with pytest.raises(ValueError, match=r"mode must be one of \('all_gather', 'ring'\), "
                                         r"got 'ulysses'"):
        context_parallel_attention(x, x, x, max_distance=1, mode="ulysses")


@pytest.mark.parametrize("mode", ["all_gather", "ring"])
def test_a_group_of_one_runs_the_local_call(mode: str) -> None:
    import torch.distributed as dist

    from relpos.functional import relative_attention

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
        table = torch.randn(3, 3, generator=g, dtype=torch.float64)
        mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
        for seed in (3, 4):
            torch.manual_seed(seed)
            got = context_parallel_attention(q, k, v, max_distance=1, rel_keys=table,
                                             rel_values=table, key_mask=mask, is_causal=True,
                                             dropout_p=0.25, mode=mode)
            torch.manual_seed(seed)
            want = relative_attention(q, k, v, max_distance=1, rel_keys=table,
                                      rel_values=table, key_mask=mask, is_causal=True,
                                      dropout_p=0.25)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_tensors_on_a_device_the_backend_does_not_serve_are_refused() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.empty(1, 1, 4, 2, device="meta")
        for mode in ("all_gather", "ring"):
            with pytest.raises(ValueError, match=r"tensors are on meta, but the process "
                                                 r"group's backend 'gloo' serves only \['cpu'\]"):
                context_parallel_attention(x, x, x, max_distance=1, mode=mode)
    finally:
        dist.destroy_process_group()


def test_unknown_layout_is_refused() -> None:
    x = _qkv()
    with pytest.raises(ValueError, match="layout must be one of"):
        context_parallel_attention(x, x, x, max_distance=1, layout="zigzag")


def test_uninitialized_group_is_refused() -> None:
    x = _qkv()
    with pytest.raises(RuntimeError, match="not initialized"):
        context_parallel_attention(x, x, x, max_distance=1)
    with pytest.raises(RuntimeError, match="not initialized"):
        shard_sequence(x, dim=2)


def test_shard_sequence_layouts() -> None:
    x = torch.arange(12)
    assert shard_sequence(x, dim=0, rank=1, world_size=3).tolist() == [4, 5, 6, 7]
    assert shard_sequence(x, dim=0, layout="head_tail", rank=1,
                          world_size=3).tolist() == [2, 3, 8, 9]
    parts = [shard_sequence(x, dim=0, layout="head_tail", rank=r, world_size=3)
             for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="multiples of 8"):
        shard_sequence(x, dim=0, layout="head_tail", rank=0, world_size=4)


def test_import_relpos_does_not_load_it() -> None:
    code = ("import sys, relpos; relpos.relative_attention; "
            "print(any(m.startswith('relpos.distributed') for m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60).stdout.strip()
    assert loaded == "False"


def test_ring_sends_bfloat16_shards_as_bfloat16() -> None:
    """Half the bytes of float32 for the shards; the gradients ride in float32 either way."""
    import torch

    from relpos.distributed import traffic

    shape = dict(world=4, batch=2, heads=3, n_local=16, head_dim=8, key_mask=True)
    f32, bf16 = (traffic("ring", dtype=dtype, **shape) for dtype in (torch.float32,
                                                                     torch.bfloat16))
    meta = traffic("ring", dtype=torch.float32, **{**shape, "n_local": 0}).forward_bytes
    assert bf16.forward_bytes - meta == (f32.forward_bytes - meta) // 2
    E = 2 * 3 * 16 * 16  # keys and values of one shard
    grads = 4 * E * 4  # P hops of float32 gradients
    assert bf16.backward_bytes - grads == (f32.backward_bytes - grads) // 2
