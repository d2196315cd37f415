"""What :func:`~relpos.distributed.context_parallel_attention` checks before it computes: each
rank's own arguments, then, in one small all-gather, that every rank agrees.

A rank whose arguments are refused still joins that all-gather (flagging the refusal), so the
other ranks raise too instead of waiting in the next collective. Ranks that disagree on an
option that must match (:data:`CALL_OPTIONS`: the layout, the mode, the window, the tables'
shapes, ...) all raise one ValueError naming the option and every rank's value. The gather
runs in the forward only, outside autograd, so the backward's collectives are the same on
every rank with or without it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relpos.functional import validate_call
from relpos.positions import check_window

#: The layouts of a sharded sequence.
LAYOUTS: tuple[str, ...] = ("contiguous", "head_tail")
#: The modes of :func:`context_parallel_attention`.
MODES: tuple[str, ...] = ("all_gather", "ring")

#: Device types each backend serves (a backend not named here is not checked).
_BACKEND_DEVICES: dict[str, frozenset[str]] = {
    "gloo": frozenset({"cpu"}),
    "mpi": frozenset({"cpu"}),
    "nccl": frozenset({"cuda"}),
    "xccl": frozenset({"xpu"}),
}


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def _chunks(layout: str, world: int) -> int:
    return world if layout == "contiguous" else 2 * world


def _initialized_group(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group "
            "first (or pass rank= and world_size= to shard_sequence)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _served(group: Any) -> set[str] | None:
    """The device types the group's backend serves (None: a backend not known here)."""
    allowed: set[str] = set()
    for part in str(dist.get_backend(group)).split(","):
        if ":" in part:  # "cpu:gloo,cuda:nccl"
            allowed.add(part.split(":", 1)[0].strip())
        elif part.strip() in _BACKEND_DEVICES:
            allowed |= _BACKEND_DEVICES[part.strip()]
        else:
            return None  # a backend this module does not know: let it answer
    return allowed


def _check_device(t: Tensor, group: Any) -> None:
    allowed = _served(group)
    if allowed is not None and t.device.type not in allowed:
        raise ValueError(
            f"tensors are on {t.device}, but the process group's backend "
            f"{str(dist.get_backend(group))!r} serves only {sorted(allowed)} tensors"
        )


def _native_for(query: Tensor, what: str) -> None:
    """Refuse ``what`` unless relpos's native CPU kernels serve ``query``."""
    from relpos.ops import native
    from relpos.ops.native import build as native_build

    if query.device.type != "cpu":
        raise ValueError(
            f"{what} runs on relpos's native CPU kernels, but the tensors are on "
            f"{query.device}: use mode='all_gather' without dropout there"
        )
    if not native.available():
        raise RuntimeError(
            f"{what} needs relpos's native CPU kernels, which are not available here: "
            f"{native_build.failure() or 'RELPOS_NATIVE=0'}"
        )


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def _gather_meta(values: list[int], device: torch.device, group: Any, world: int) -> list[
    list[int]
]:
    """One small all_gather of a few integers per rank (shapes, options), before a big one."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p.tolist() for p in parts]


def meta_device(query: object, group: Any) -> torch.device | None:
    """Where the agreement's all-gather runs: the CPU where the backend serves it (the same
    on every rank, whatever device each rank's tensors are on), else the query's device,
    else the current CUDA device; None if none is known to work."""
    allowed = _served(group)
    if allowed is not None and "cpu" in allowed:
        return torch.device("cpu")
    if isinstance(query, Tensor) and (allowed is None or query.device.type in allowed):
        return query.device
    if allowed is not None and "cuda" in allowed and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


# ----------------------------------------------------------------------------------------------
# Options as integers


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


_DTYPES = {_code(str(d)): str(d) for d in (torch.float16, torch.bfloat16, torch.float32,
                                            torch.float64)}
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "meta")
_GRADS = {0: "none", 1: "query/tables only", 3: "key/value"}


def _named(names: Sequence[str]) -> Callable[[tuple[int, ...]], str]:
    return lambda v: repr(names[v[0]]) if 0 <= v[0] < len(names) else f"#{v[0]}"


def _shape(v: tuple[int, ...]) -> str:
    return "None" if v[0] == 0 else str(tuple(v[1:1 + v[0]]))


def _scale(v: tuple[int, ...]) -> str:
    return repr(_float(v[1])) if v[0] else f"None (D**-0.5 = {_float(v[1])!r})"


@dataclass(frozen=True)
class Option:
    """One thing every rank must agree on, as ``width`` integers: ``show`` writes a rank's
    value, ``key`` is what must be equal (all the integers by default), ``hint`` adds what to
    do, ``compared=False`` carries a value without checking it (rank 0's dropout seed; such
    options come after all the compared ones)."""

    name: str
    width: int = 1
    show: Callable[[tuple[int, ...]], str] = lambda v: str(v[0])
    key: Callable[[tuple[int, ...]], object] = lambda v: v
    hint: Callable[[list[dict[str, tuple[int, ...]]], int], str] | None = None
    compared: bool = True


def _pad_hint(rows: list[dict[str, tuple[int, ...]]], world: int) -> str:
    layout = LAYOUTS[rows[0]["layout"][0]]
    return (f"layout {layout!r} needs one shard length on every rank: pad the sequence to a "
            f"multiple of {_chunks(layout, world)} (mask the padding with key_mask) and shard "
            f"it with shard_sequence")


#: What every rank of a :func:`context_parallel_attention` call must agree on, in the order
#: it is checked (the layout first: the shard length's hint names it).
CALL_OPTIONS: tuple[Option, ...] = (
    Option("layout", show=_named(LAYOUTS)),
    Option("mode", show=_named(MODES)),
    Option("n_local (the shard length)", hint=_pad_hint),
    Option("B (batch size)"),
    Option("H (heads)"),
    Option("D (head dim)"),
    Option("Dv (value head dim)"),
    Option("key_mask", show=lambda v: "given" if v[0] else "None"),
    Option("dtype", show=lambda v: _DTYPES.get(v[0], f"#{v[0]}")),
    Option("autocast", show=lambda v: _DTYPES.get(v[0], f"#{v[0]}") if v[0] else "off"),
    Option("device type", show=_named(_DEVICE_TYPES)),
    Option("head_group", show=lambda v: str(v[0]) if v[0] else "None"),
    Option("is_causal", show=lambda v: str(bool(v[0]))),
    Option("max_distance", 2, show=lambda v: str(v[0]) if v[0] == v[1] else str(v)),
    Option("scale", 2, show=_scale, key=lambda v: _float(v[1])),
    Option("dropout_p", show=lambda v: repr(_float(v[0])), key=lambda v: _float(v[0])),
    Option("rel_keys", 4, show=_shape),
    Option("rel_values", 4, show=_shape),
    Option("requires_grad (which inputs need gradients: the backward's collectives follow)",
           show=lambda v: _GRADS.get(v[0], f"#{v[0]}")),
    Option("dropout seed", 2, compared=False),
)

#: Integers each rank contributes to the all-gather that checks a call first (a refusal
#: flag, then :data:`CALL_OPTIONS`).
META_INTS = 1 + sum(o.width for o in CALL_OPTIONS)


def check_arguments(query: Tensor, key: Tensor, value: Tensor, *, max_distance: object,
                    rel_keys: Tensor | None, rel_values: Tensor | None, is_causal: bool,
                    key_mask: Tensor | None, dropout_p: float, scale: float | None,
                    layout: object, mode: object, head_group: object) -> None:
    """This rank's own arguments, before any collective (TypeError / ValueError)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_layout(layout)
    validate_call(query, key, value, max_distance=max_distance,  # type: ignore[arg-type]
                  rel_keys=rel_keys, rel_values=rel_values, key_mask=key_mask,
                  is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"context_parallel_attention is self-attention: query and key shards need one "
            f"length, got {query.shape[2]} and {key.shape[2]}"
        )
    if head_group is not None:
        if isinstance(head_group, bool) or not isinstance(head_group, int) or head_group < 1:
            raise ValueError(f"head_group must be an int >= 1 or None, got {head_group!r}")
        if mode != "all_gather":
            raise ValueError(f"head_group bounds what mode='all_gather' gathers; mode={mode!r} "
                             "holds a few shards at a time already: leave head_group=None")
        if float(dropout_p) > 0.0:
            raise ValueError("head_group with dropout_p > 0 is not supported (the dropout "
                             "stream is keyed by head): use head_group=None or mode='ring'")


def call_values(query: Tensor, key: Tensor, value: Tensor, *, max_distance: int | tuple[
                int, int], rel_keys: Tensor | None, rel_values: Tensor | None, is_causal: bool,
                key_mask: Tensor | None, dropout_p: float, scale: float | None, layout: str,
                mode: str, head_group: int | None, seed: Tensor) -> list[tuple[int, ...]]:
    """This rank's :data:`CALL_OPTIONS` (arguments that :func:`check_arguments` passed)."""
    B, H, n_local, D = query.shape
    dev = query.device.type
    low = torch.get_autocast_dtype(dev) if dev in ("cpu", "cuda", "xpu", "mps") and \
        torch.is_autocast_enabled(dev) else None

    def table(t: Tensor | None) -> tuple[int, ...]:
        if t is None:
            return (0, 0, 0, 0)
        return (t.dim(), *t.shape, *[0] * (3 - t.dim()))

    needs = [t is not None and t.requires_grad for t in (query, key, value, rel_keys, rel_values)]
    grad = 0 if not torch.is_grad_enabled() else (
        3 if needs[1] or needs[2] else 1 if any(needs) else 0)
    left, right = check_window(max_distance)
    values: list[tuple[int, ...]] = [
        (LAYOUTS.index(layout),), (MODES.index(mode),), (n_local,), (B,), (H,), (D,),
        (value.shape[3],), (int(key_mask is not None),), (_code(str(query.dtype)),),
        (0 if low is None else _code(str(low)),),
        (_DEVICE_TYPES.index(dev) if dev in _DEVICE_TYPES else len(_DEVICE_TYPES) + _code(dev),),
        (head_group or 0,), (int(is_causal),), (left, right),
        (int(scale is not None), _bits(D ** -0.5 if scale is None else float(scale))),
        (_bits(float(dropout_p)),), table(rel_keys), table(rel_values), (grad,),
        tuple(int(s) for s in seed.tolist()),
    ]
    return values


def _ranks(values: list[str]) -> str:
    """``rank 0 'a', rank 1 'b'``; beyond 8 ranks grouped by value (``'a' on ranks 0-2, 5``)."""
    if len(values) <= 8:
        return ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    parts = []
    for v, ranks in groups.items():
        runs: list[tuple[int, int]] = []
        for r in ranks:
            if runs and runs[-1][1] == r - 1:
                runs[-1] = (runs[-1][0], r)
            else:
                runs.append((r, r))
        spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        parts.append(f"{v} on ranks {spans}")
    return "; ".join(parts)


def agree(what: str, options: Sequence[Option], values: Sequence[tuple[int, ...]] | None,
          refused: BaseException | None, *, device: torch.device | None, group: Any,
          world: int) -> dict[str, tuple[int, ...]]:
    """One all-gather of ``values`` (this rank's ``options``; None where ``refused``), then
    the same outcome on every rank: ``refused`` re-raised where it was raised and a
    ValueError quoting it on the other ranks; else a ValueError naming the first option the
    ranks disagree on and every rank's value; else rank 0's values by option name."""
    if device is None:  # nowhere known to gather: this rank's refusal is all it can say
        raise refused if refused is not None else RuntimeError(
            f"{what}: no device to check the ranks' arguments on for the process group's "
            f"backend {str(dist.get_backend(group))!r}")
    flat = [int(refused is not None)]
    for i, o in enumerate(options):
        v = (0,) * o.width if values is None else values[i]
        assert len(v) == o.width, (o.name, v)
        flat += v
    rows = _gather_meta(flat, device, group, world)
    who = [r for r, row in enumerate(rows) if row[0]]
    if who:
        if len(who) < world:  # the others learn why (the error path only: one more gather)
            said: list[object] = [None] * world
            mine = None if refused is None else f"{type(refused).__name__}: {refused}"
            dist.all_gather_object(said, mine, group=group)
        if refused is not None:
            raise refused
        ranks = f"rank {who[0]}" if len(who) == 1 else f"ranks {who}"
        raise ValueError(f"{what}: {ranks} refused the arguments given there, so every rank "
                         f"stops here; rank {who[0]} said {said[who[0]]}")
    # The common case: every compared integer equal (the uncompared options come last).
    first = next((i for i, o in enumerate(options) if not o.compared), len(options))
    compared = 1 + sum(o.width for o in options[:first])
    if not any(o.compared for o in options[first:]) and all(
            row[:compared] == rows[0][:compared] for row in rows[1:]):
        return _by_name(options, rows[0])
    parsed = [_by_name(options, row) for row in rows]
    for o in options:
        keys = [o.key(p[o.name]) for p in parsed]
        if o.compared and any(k != keys[0] for k in keys):
            shown = _ranks([o.show(p[o.name]) for p in parsed])
            hint = "every rank must pass the same" if o.hint is None else o.hint(parsed, world)
            raise ValueError(f"{what}: the ranks disagree on {o.name}: {shown}; {hint}")
    return parsed[0]


def _by_name(options: Sequence[Option], row: list[int]) -> dict[str, tuple[int, ...]]:
    at, out = 1, {}
    for o in options:
        out[o.name] = tuple(row[at:at + o.width])
        at += o.width
    return out
