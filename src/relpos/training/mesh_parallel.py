"""Context parallelism, FSDP2 and activation checkpointing for :func:`relpos.training.train`.

A run of ``P = dp x cp`` processes lays its ranks on a ``(dp, cp)`` device mesh
(``torch.distributed.device_mesh.init_device_mesh``; rank ``r`` is ``dp_rank * cp +
cp_rank``). The ``dp`` ranks split each global batch's rows
(:func:`~relpos.training.data_parallel.rank_share`); the ``cp`` ranks of one ``dp`` group take
the same rows and split their sequence (:func:`relpos.distributed.shard_sequence`:
``head_tail`` for a causal model, so every rank gets the same causal work; ``contiguous``
otherwise), and the model's self-attention runs under
:func:`relpos.distributed.context_parallel`. Gradients are averaged over all ``P`` ranks, by
DDP or, with ``fsdp``, by FSDP2 (``fully_shard`` on every block and on the root, over the
flattened ``dp x cp`` mesh, as torchtitan composes them); the loss of every rank is its
share of the global batch's summed cross-entropy over the global count of scored tokens,
times ``P``, so the average is the single-process gradient of the whole batch.
``activation_checkpointing`` recomputes each block in the backward (non-reentrant
``torch.utils.checkpoint``, RNG state restored: attention dropout draws the same mask
again).

Checkpoints stay the single-process format (gathered full weights and optimizer state in
safetensors, written by rank 0), so a run resumes at any world size, with or without any
of these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from relpos.training.data_parallel import DistContext
from relpos.training.tasks import Batch

__all__ = ["Layout", "Parallelism"]

_CP_MODES = ("ring", "all_gather")


@dataclass(frozen=True)
class Parallelism:
    """How a run spreads over its processes beyond data parallelism.

    Attributes:
        context_parallel: ranks that share one sequence (``cp``); the world size must be a
            multiple of it.
        mode: ``context_parallel_attention``'s mode, ``"ring"`` (memory) or
            ``"all_gather"``.
        fsdp: shard weights, gradients and optimizer state with FSDP2 instead of DDP.
        activation_checkpointing: recompute each block's activations in the backward.
    """

    context_parallel: int = 1
    mode: str = "ring"
    fsdp: bool = False
    activation_checkpointing: bool = False

    def check(self, world_size: int) -> None:
        """Raise ``ValueError`` unless this fits a run of ``world_size`` processes."""
        cp = self.context_parallel
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ValueError(f"context_parallel must be an int >= 1, got {cp!r}")
        if world_size % cp:
            raise ValueError(
                f"context parallelism over {cp} ranks needs a world size that is a multiple "
                f"of {cp}, got {world_size} processes (allowed: --nproc {cp}, {2 * cp}, ...)"
            )
        if self.mode not in _CP_MODES:
            raise ValueError(f"mode must be one of {_CP_MODES}, got {self.mode!r}")

    @property
    def spans_ranks(self) -> bool:
        """Whether one rank's model cannot run alone (its attention or weights span ranks)."""
        return self.context_parallel > 1 or self.fsdp


@dataclass
class Layout:
    """Where this rank stands on the ``(dp, cp)`` mesh."""

    dp: DistContext  # the data-parallel position (rank, size) this rank's rows are cut by
    cp_rank: int = 0
    cp_size: int = 1
    sequence_layout: str = "contiguous"
    mesh: Any = None  # DeviceMesh (dp, cp), or None in one process
    cp_group: Any = None

    @property
    def chunks(self) -> int:
        """Equal chunks a sharded sequence is cut into (its length must be a multiple)."""
        return self.cp_size * (2 if self.sequence_layout == "head_tail" else 1)


def layout(ctx: DistContext, par: Parallelism, *, causal: bool) -> Layout:
    """This rank's place on the ``(dp, cp)`` mesh (the mesh is built on every rank)."""
    par.check(ctx.world_size)
    sequence_layout = "head_tail" if causal else "contiguous"
    if not ctx.distributed:
        return Layout(dp=ctx, sequence_layout=sequence_layout)
    from torch.distributed.device_mesh import init_device_mesh

    cp = par.context_parallel
    dp = ctx.world_size // cp
    mesh = init_device_mesh(ctx.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    return Layout(
        dp=DistContext(rank=dp_rank, world_size=dp, local_rank=ctx.local_rank,
                       device=ctx.device),
        cp_rank=cp_rank, cp_size=cp, sequence_layout=sequence_layout, mesh=mesh,
        cp_group=mesh.get_group("cp") if cp > 1 else None,
    )


def shard_batch(batch: Batch, lay: Layout) -> Batch:
    """This rank's part of its data-parallel rows: their sequence cut as the layout says,
    after padding it on the right (key mask False, nothing scored) to a multiple of the
    layout's chunks. Unchanged without context parallelism."""
    if lay.cp_size == 1:
        return batch
    from relpos.distributed import shard_sequence

    B, n = batch.ids.shape
    extra = -n % lay.chunks
    key_mask = batch.key_mask
    if extra or key_mask is not None:
        key_mask = torch.ones(B, n, dtype=torch.bool, device=batch.ids.device) \
            if key_mask is None else key_mask

    def padded(x: Tensor, value: int | bool) -> Tensor:
        return torch.nn.functional.pad(x, (0, extra), value=value) if extra else x

    def cut(x: Tensor) -> Tensor:
        return shard_sequence(x, dim=1, layout=lay.sequence_layout, rank=lay.cp_rank,
                              world_size=lay.cp_size)

    return Batch(
        cut(padded(batch.ids, 0)), cut(padded(batch.targets, 0)), cut(padded(batch.mask, False)),
        {k: cut(padded(v, -1)) for k, v in batch.meta.items()},
        None if key_mask is None else cut(padded(key_mask, False)),
    )


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no .layers (a ModuleList of blocks)")
    return list(layers)


def parallelize(model: nn.Module, ctx: DistContext, lay: Layout, par: Parallelism) -> nn.Module:
    """Apply activation checkpointing, context parallelism and FSDP2 (in that order, on
    ``model`` itself) and return what runs the training step: ``model``, or DDP around it."""
    if par.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in _blocks(model):
            checkpoint(block)  # non-reentrant; parameter names unchanged
    if lay.cp_size > 1:
        from relpos.distributed import context_parallel

        context_parallel(model, lay.cp_group, layout=lay.sequence_layout, mode=par.mode)
    if par.fsdp and ctx.distributed:
        from torch.distributed.fsdp import fully_shard

        mesh = lay.mesh._flatten("dp_cp")
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if ctx.distributed:
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return model


def _names(model: nn.Module, groups: list[dict[str, Any]]) -> list[str]:
    """Parameter names in the order of the optimizer's groups (an index is a position)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id[id(p)] for g in groups for p in g["params"]]


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any], names: list[str]) -> None:
    """Load a single-process ``optimizer.state_dict()`` (parameters by index, ``names``
    giving each index's parameter) into the optimizer of the sharded ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # Every rank must hand torch the same order (parameters, and each one's entries): its
    # full-state loading walks the dicts in lockstep with collectives, so two ranks that
    # hold them in different orders (a checkpoint's tensors come back from safetensors in
    # an order of their own in each process) pair the wrong tensors, silently.
    by_name: Any = {
        "state": {names[i]: dict(sorted(state["state"][i].items()))
                  for i in sorted(state["state"])},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                         for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True))


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str], *,
               fsdp: bool) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The whole model's ``state_dict()`` and the optimizer's in the single-process format
    (parameters by index). With FSDP every rank must call it (it gathers); rank 0 gets the
    states, the others empty ones."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights: Any = get_model_state_dict(model, options=options)
    optim: Any = get_optimizer_state_dict(model, optimizer, options=options)
    if not weights:
        return {}, {}
    index = {name: i for i, name in enumerate(names)}
    return dict(weights), {
        "state": {index[name]: v for name, v in optim["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                         for g in optim["param_groups"]],
    }


def full_weights(model: nn.Module, *, fsdp: bool) -> dict[str, Tensor]:
    """The whole model's ``state_dict()`` (with FSDP: gathered; every rank must call it, rank
    0 gets the weights, the others an empty dict)."""
    if not fsdp:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights: Any = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return dict(weights)


@contextlib.contextmanager
def fresh_rng() -> Iterator[None]:
    """Leave torch's CPU random state as it was (building an evaluation copy draws from it)."""
    with torch.random.fork_rng(devices=[]):
        yield
