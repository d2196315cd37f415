"""Which backend serves a packed call, and why the others do not.

The native kernels take a packed call whole (one op), and so do the triton kernels wherever the
padded triton backend serves the call's sequences. Every other backend (decode, flash_regions,
bucketed, reference) serves it in padded groups of sequences of similar lengths
(:mod:`relpos.varlen.running`): one padded call per group, each sequence's queries and keys
aligned to the end of the group's rows. Such a backend serves the packed call only if it
serves every group: auto-selection asks the groups' padded shapes for the backend's hard limits
(the decode backend's ``L <= 64``, say, so a prefill among decode steps rules it out, whichever
sequence is longest; limits only tighten as a call grows, so the groups with the most queries,
keys, sequences and scores decide), and asks the sequence with the most query-key pairs for
speed (the padded call's own auto-selection), then picks the first backend, in
:data:`relpos.ops.BACKENDS` order, that passes both: one backend for the whole call, which
never refuses a sequence of it.

Shape legend: N sequences, H heads, D head dim, Dv value head dim; L_s, S_s the queries and
the keys sequence s uses; a group of n sequences is padded to ``(n, H, Lp, D)`` queries and
``(n, H, Sp, D)`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from relpos.functional import Implementation, _unsupported_reasons, validate_call
from relpos.ops import BACKENDS, BackendReasons
from relpos.ops.call import AttentionCall
from relpos.varlen.call import PackedAttentionCall

__all__ = ["CALL_SCORES", "GATHER_MOST", "GROUP_MOST", "Group", "Plan", "explain",
           "group_call",
           "group_sequences", "plan"]

_NATIVE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_ONE_CALL = ("native", "triton")  # the backends with a packed kernel
GROUPED = tuple(name for name in BACKENDS if name not in _ONE_CALL)
"""The backends that serve a packed call in padded groups of sequences."""

CALL_SCORES = 1 << 14
"""Scores (``H·L·S`` query-key pairs over the heads) that cost about as much as one call's
fixed cost (validation, selection, the backend's small operations: 0.1-0.5 ms): a group may
compute this many padding scores for each call it saves."""

GATHER_MOST = 1 << 17
"""Bytes of keys and values (``S_s·H·(D + Dv)`` elements) up to which a sequence is copied
into a padded group. Copying more costs more than the call it saves (0.1-0.3 ms: 128 KiB are
32 keys at H = 8, D = Dv = 64 in float32, whose gather into fresh memory takes about as long
on one core), so a longer sequence runs alone or beside its equals (a view, no copy)."""

GROUP_MOST = 1 << 24
"""The most scores a group holds (128 MiB of float64 scores), unless one sequence alone has
more: the padded backends keep ``(n, H, Lp, Sp)`` scores (bucketed) or ``(Lp, Sp, D)`` tables
(reference), and a packed call should not need more memory than its longest sequence does
alone or than a modest padded batch."""


@dataclass(frozen=True)
class Group:
    """Sequences served by one padded call: ``members`` (each with ``L_s > 0`` and
    ``S_s > 0``), padded to ``queries`` = max L_s and ``keys`` = max S_s; ``masked``: some member
    uses fewer keys than ``keys`` (a key mask hides the front of its row)."""

    members: tuple[int, ...]
    queries: int
    keys: int
    masked: bool


@dataclass(frozen=True)
class Plan:
    """How a packed call runs: ``backend``, and for a grouped backend its ``groups``."""

    backend: str
    groups: tuple[Group, ...] = ()


def group_sequences(call: PackedAttentionCall) -> tuple[Group, ...]:
    """The sequences that attend something (``L_s > 0``, ``S_s > 0``) in groups.

    A short sequence (keys and values of at most :data:`GATHER_MOST` bytes) is copied into a
    padded group: sorted by (L_s, S_s), the groups are cut where one would compute more
    padding scores than :data:`CALL_SCORES` for each call it saves, or hold more than
    :data:`GROUP_MOST` scores. A longer
    one is not copied: it runs alone, or with the sequences beside it of the same shape and
    key region (a view of the packed tensors, no copy)."""
    assert call.lengths_q is not None and call.lengths_k is not None
    lq, lk = call.lengths_q, call.lengths_k
    regions = lk if call.regions_k is None else call.regions_k
    H, D, Dv = call.query.shape[1], call.query.shape[2], call.value.shape[2]
    key_bytes = H * (D + Dv) * call.query.element_size()
    groups: list[Group] = []
    short: list[int] = []
    run: list[int] = []  # long sequences side by side, of one shape

    def close(members: list[int], Lp: int, Sp: int) -> None:
        if members:
            groups.append(Group(tuple(members), Lp, Sp, any(lk[m] != Sp for m in members)))

    for s, (L, S) in enumerate(zip(lq, lk, strict=True)):
        if L == 0 or S == 0:
            continue
        if S * key_bytes <= GATHER_MOST:
            short.append(s)
            continue
        last = run[-1] if run else -2
        if not (last == s - 1 and (lq[last], lk[last], regions[last]) == (L, S, regions[s])
                and (len(run) + 1) * H * L * S <= GROUP_MOST):
            close(run, lq[last], lk[last])
            run = []
        run.append(s)
    if run:
        close(run, lq[run[0]], lk[run[0]])
    members: list[int] = []
    Lp = Sp = real = 0
    for s in sorted(short, key=lambda s: (lq[s], lk[s])):
        L, S = lq[s], lk[s]
        new_L, new_S = max(Lp, L), max(Sp, S)
        padded = (len(members) + 1) * new_L * new_S * H
        if members and (padded - (real + L * S) * H > len(members) * CALL_SCORES
                        or padded > GROUP_MOST):
            close(members, Lp, Sp)
            members, real, new_L, new_S = [], 0, L, S
        members.append(s)
        Lp, Sp, real = new_L, new_S, real + L * S
    close(members, Lp, Sp)
    return tuple(groups)


def _stand_in(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype | None = None,
              grad: bool = False) -> Tensor:
    """A tensor of ``shape`` that holds one element (zero strides): to ask about a call."""
    t = torch.zeros((), dtype=like.dtype if dtype is None else dtype, device=like.device)
    t = t.expand(shape)
    return t.detach().requires_grad_(True) if grad else t


def group_call(call: PackedAttentionCall, group: Group, *, masked: bool) -> AttentionCall:
    """A call of ``group``'s padded shape (with its key mask when ``masked``), to ask backends
    whether they serve it; its tensors hold no data."""
    n, H, D = len(group.members), call.query.shape[1], call.query.shape[2]
    Dv = call.value.shape[2]
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (call.query, call.key, call.value, call.rel_keys, call.rel_values))
    q = _stand_in((n, H, group.queries, D), call.query, grad=grad)
    k = _stand_in((n, H, group.keys, D), call.query)
    v = _stand_in((n, H, group.keys, Dv), call.query)
    key_mask = _stand_in((n, group.keys), call.query, torch.bool) if masked else None
    return validate_call(q, k, v, **call.padded_kwargs(),  # type: ignore[arg-type]
                         key_mask=key_mask)


def _native_reason(call: PackedAttentionCall) -> str | None:
    """Why the native kernels do not serve the packed call: they cannot, or, picking by
    itself (``implementation=None``), they have no vector code and a sequence has more than
    ``native.SCALAR_MAX_KEYS`` keys, and the other backends can take the call in padded
    groups (not under torch.compile)."""
    from relpos.ops import native

    if call.query.device.type != "cpu":
        return (f"device {call.query.device} is not supported by the native CPU kernels "
                "(allowed: cpu)")
    if call.query.dtype not in _NATIVE_DTYPES:
        return f"dtype {call.query.dtype} is not supported (allowed: {_NATIVE_DTYPES})"
    state = native._state()
    if state or call.implementation is not None or call.lengths_k is None:
        return state or None
    longest = max(call.lengths_k, default=0)
    if native._scalar_rows() and longest > native.SCALAR_MAX_KEYS:
        return native.SCALAR_REASON.format(S=longest)
    return None


def longest(call: PackedAttentionCall) -> int:
    """The sequence with the most query-key pairs (-1 without sequences)."""
    assert call.lengths_q is not None and call.lengths_k is not None
    pairs = [L * S for L, S in zip(call.lengths_q, call.lengths_k, strict=True)]
    return max(range(len(pairs)), key=pairs.__getitem__) if pairs else -1


def _longest_reasons(call: PackedAttentionCall) -> dict[str, str | None]:
    """Every backend with why the padded call of the sequence with the most query-key pairs
    would not run it (auto-selection's reasons, or the named implementation's), or None; all
    None when no sequence attends anything."""
    s = longest(call)
    assert call.lengths_q is not None and call.lengths_k is not None
    if s < 0 or call.lengths_q[s] == 0 or call.lengths_k[s] == 0:  # nothing to attend
        return dict.fromkeys(BACKENDS, None)
    from relpos.functional import explain_backends

    q, k, v = call.sequence(s)
    return explain_backends(q, k, v, **call.padded_kwargs(),  # type: ignore[arg-type]
                            implementation=cast(Implementation | None, call.implementation))


def _group_reasons(call: PackedAttentionCall, groups: tuple[Group, ...], names: tuple[str, ...]
                   ) -> dict[str, str | None]:
    """Every backend of ``names`` with why it cannot serve some group (its first refusal,
    naming the group's sequence with the most queries), or None: it serves them all. A
    backend's limits only tighten as a call grows, so the groups with the most queries, keys,
    sequences and scores decide (no need to ask every group)."""
    assert call.lengths_q is not None and call.lengths_k is not None
    reasons: dict[str, str | None] = dict.fromkeys(names, None)
    sizes = (lambda g: g.queries, lambda g: g.keys, lambda g: len(g.members),
             lambda g: len(g.members) * g.queries * g.keys)
    extremes = {id(g): g for g in (max(groups, key=size) for size in sizes)} if groups else {}
    for group in extremes.values():
        asked = [name for name in names if reasons[name] is None]
        if not asked:
            break
        found = _unsupported_reasons(group_call(call, group, masked=False), asked)
        s = max(group.members, key=call.lengths_q.__getitem__)
        for name, reason in found.items():
            if reason is not None:
                reasons[name] = (
                    f"{reason} (sequence {s}: L={call.lengths_q[s]}, S={call.lengths_k[s]}, "
                    f"in a padded group of {len(group.members)} sequences, L={group.queries}, "
                    f"S={group.keys})")
    return reasons


_COMPILE_REASON = ("under torch.compile only the native kernels serve a packed call (one op; "
                   "the others would read the sequence lengths)")


def _reasons(call: PackedAttentionCall) -> tuple[dict[str, str | None], tuple[Group, ...]]:
    """Every backend, native first, with why it would not serve the packed call (None: it
    would), and the groups the grouped backends would run."""
    reasons: dict[str, str | None] = {"native": _native_reason(call)}
    if call.lengths_q is None or call.lengths_k is None:
        reasons.update(dict.fromkeys((n for n in BACKENDS if n != "native"), _COMPILE_REASON))
        return reasons, ()
    groups = group_sequences(call)
    asked = call.implementation
    per_longest = _longest_reasons(call)
    hard = _group_reasons(call, groups, tuple(n for n in GROUPED if asked in (None, n)))
    for name in BACKENDS:
        if name == "native":
            continue
        if name == "triton":
            reason = per_longest[name]
            reasons[name] = None if reason is None else (
                f"{reason} (asked about the longest sequence; it takes a packed call in one "
                "call)")
        elif hard.get(name) is not None:
            reasons[name] = hard[name]
        elif asked is None and per_longest[name] is not None:
            reasons[name] = (f"{per_longest[name]} (auto-selection asked about the sequence "
                             "with the most query-key pairs)")
        else:
            reasons[name] = None
    if asked is not None:
        reasons = {name: reasons[name] if name == asked else
                   f"implementation={asked!r} was asked for" for name in reasons}
    return reasons, groups


def explain(call: PackedAttentionCall) -> BackendReasons:
    """Every backend, native first, with why it would not serve the packed call (None: it
    would); auto-selection takes the first None."""
    return BackendReasons(_reasons(call)[0])


def plan(call: PackedAttentionCall) -> Plan:
    """The backend that runs the packed call (and its groups): the one asked for, if it serves
    the call, or the first whose reason is None.

    Raises:
        RuntimeError: if the named ``implementation`` cannot serve the call.
    """
    if call.implementation in (None, "native") and _native_reason(call) is None:
        return Plan("native")  # the other backends need not be asked (a decoding step's cost)
    reasons, groups = _reasons(call)
    if call.implementation is not None:
        reason = reasons[call.implementation]
        if reason is not None:
            raise RuntimeError(f"implementation {call.implementation!r} cannot serve this "
                               f"packed call: {reason}")
        return Plan(call.implementation, groups)
    for name, reason in reasons.items():
        if reason is None:
            return Plan(name, groups)
    raise RuntimeError("no backend serves this packed call: "
                       + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
