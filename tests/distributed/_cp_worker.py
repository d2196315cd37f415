"""One rank of tests/distributed/test_context_parallel.py (run as a script: RANK WORLD PORT).

Runs every case on its rank, compares with the single-process run to 1e-10, and prints one
``FAIL ...`` line per mismatch; exits 1 if any. Run by the test with a timeout, never alone.
"""

from __future__ import annotations

import datetime
import itertools
import sys
import traceback

import torch
import torch.distributed as dist

from relpos.distributed import (
    context_parallel,
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)
from relpos.functional import relative_attention

TOL = 1e-10
B, H, D, DV = 2, 2, 3, 2


def _tables(kind: str, R: int, g: torch.Generator) -> tuple[torch.Tensor | None, ...]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
    if kind == "keys":
        return t(R, D), None
    if kind == "values":
        return None, t(R, DV)
    if kind == "shared":
        return t(R, D), t(R, DV)
    return t(H, R, D), t(H, R, DV)  # per head


def _close(name: str, a: torch.Tensor | None, b: torch.Tensor | None, fails: list[str]) -> None:
    if a is None or b is None:
        if (a is None) != (b is None):
            fails.append(f"{name}: one gradient is None")
        return
    err = (a - b).abs().max().item() if a.numel() else 0.0
    if not err <= TOL:
        fails.append(f"{name}: max error {err}")


def run_case(rank: int, world: int, *, K: int | tuple[int, int], chunk: int, causal: bool,
             tables: str, mask: str, layout: str, seed: int, mode: str = "all_gather",
             dropout: float = 0.0, head_group: int | None = None,
             strided: bool = False) -> list[str]:
    chunks = world if layout == "contiguous" else 2 * world
    n = chunk * chunks
    left, right = (K, K) if isinstance(K, int) else K
    R = left + right + 1
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=torch.float64)
               for d in (D, D, DV))
    w = torch.randn(B, H, n, DV, generator=g, dtype=torch.float64)
    rk, rv = _tables(tables, R, g)
    key_mask = None
    if mask == "random":
        key_mask = torch.rand(B, n, generator=g) > 0.3
    elif mask == "hide_rank1":  # rank 1 holds only padding: unequal work per rank
        key_mask = torch.ones(B, n, dtype=torch.bool)
        hidden = shard_sequence(torch.arange(n), dim=0, layout=layout, rank=1, world_size=world)
        key_mask[:, hidden] = False
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    # With dropout: the single-process native call drawn after manual_seed(seed); the ranks
    # seed their generators differently (rank 0 as the single process): rank 0's draw rules.
    torch.manual_seed(seed)
    ref = relative_attention(*full, max_distance=K, rel_keys=rk, rel_values=rv,
                             key_mask=key_mask, is_causal=causal, dropout_p=dropout,
                             implementation="native" if dropout else None)
    (ref * w).sum().backward()
    ref_tables = [None if t is None else t.grad.clone() for t in (rk, rv)]
    for t in (rk, rv):
        if t is not None:
            t.grad = None

    def shard(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return shard_sequence(x, dim=dim, layout=layout)

    if strided:  # non-contiguous shards: (B, n_local, H, D) memory seen as (B, H, n_local, D)
        leaves = [shard(t).transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
        inputs = [x.transpose(1, 2) for x in leaves]
    else:
        leaves = inputs = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed + 7919 * rank)
    out = context_parallel_attention(
        *inputs, max_distance=K, rel_keys=rk, rel_values=rv, is_causal=causal,
        key_mask=None if key_mask is None else shard(key_mask, 1), layout=layout, mode=mode,
        dropout_p=dropout, head_group=head_group)
    (out * shard(w)).sum().backward()
    fails: list[str] = []
    _close("out", out.detach(), shard(ref.detach()), fails)
    for name, mine, whole in zip(("dq", "dk", "dv"), leaves, full, strict=True):
        grad = mine.grad.transpose(1, 2) if strided else mine.grad
        _close(name, grad, shard(whole.grad), fails)
    for name, t, want in zip(("d rel_keys", "d rel_values"), (rk, rv), ref_tables, strict=True):
        if t is not None:
            total = t.grad.clone()
            dist.all_reduce(total)
            _close(name, total, want, fails)
    return fails


def cases(world: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    table_kinds = itertools.cycle(["keys", "values", "shared", "per_head"])
    masks = itertools.cycle(["none", "random", "none", "hide_rank1"])
    for K, causal, layout, mode in itertools.product(
            (0, 1, 3, (2, 1), (0, 3)), (False, True), ("contiguous", "head_tail"),
            ("all_gather", "ring")):
        base = max(K) if isinstance(K, tuple) else K
        for chunk in sorted({max(c, 1) for c in (base - 1, base, base + 1, 3 * base)}):
            out.append(dict(K=K, chunk=chunk, causal=causal, tables=next(table_kinds),
                            mask=next(masks), layout=layout, seed=len(out), mode=mode))
    # Every table kind with each mask kind at least once, causal head_tail (unequal work).
    for i, (tables, mask, mode) in enumerate(itertools.product(
            ("keys", "values", "shared", "per_head"), ("none", "random", "hide_rank1"),
            ("all_gather", "ring"))):
        out.append(dict(K=(2, 1), chunk=2, causal=True, tables=tables, mask=mask,
                        layout="head_tail", seed=1000 + i, mode=mode))
    # Dropout keyed by global positions: equals the single-process native call's mask.
    for i, (causal, layout, mode) in enumerate(itertools.product(
            (False, True), ("contiguous", "head_tail"), ("all_gather", "ring"))):
        out.append(dict(K=2, chunk=3, causal=causal, tables="shared", mask="random",
                        layout=layout, seed=2000 + i, mode=mode, dropout=0.3))
    # Non-contiguous shards (a transposed view), both modes and layouts, causal and not.
    for i, (causal, layout, mode) in enumerate(itertools.product(
            (False, True), ("contiguous", "head_tail"), ("all_gather", "ring"))):
        out.append(dict(K=(2, 1), chunk=3, causal=causal, tables="per_head", mask="random",
                        layout=layout, seed=4000 + i, mode=mode, strided=True))
    # All-gather mode a head at a time (re-gathered in the backward): every table kind and
    # mask, causal and not, both layouts.
    for i, (tables, mask, causal, layout) in enumerate(itertools.product(
            ("keys", "values", "shared", "per_head"), ("none", "random"), (False, True),
            ("contiguous", "head_tail"))):
        out.append(dict(K=(2, 1), chunk=2, causal=causal, tables=tables, mask=mask,
                        layout=layout, seed=3000 + i, mode="all_gather", head_group=1))
    return out


def refusals(rank: int, world: int) -> list[str]:
    fails: list[str] = []
    # Uneven shards: rank 0 one position longer; every rank raises, none hangs.
    n_local = 3 + (rank == 0)
    x = torch.randn(1, 1, n_local, 2, dtype=torch.float64)
    try:
        context_parallel_attention(x, x, x, max_distance=1)
        fails.append("uneven shards were not refused")
    except ValueError as e:
        if "the ranks disagree on n_local (the shard length): rank 0 4, rank 1 3" not in str(e):
            fails.append(f"uneven shards: unclear error {e}")
    # Odd head_tail shard.
    x = torch.randn(1, 1, 3, 2, dtype=torch.float64)
    try:
        context_parallel_attention(x, x, x, max_distance=1, layout="head_tail")
        fails.append("odd head_tail shard was not refused")
    except ValueError as e:
        if "head_tail" not in str(e):
            fails.append(f"odd head_tail: unclear error {e}")
    # head_group: all-gather mode only, no dropout, an int >= 1 (refused before any
    # collective, on every rank alike).
    x = torch.randn(1, 2, 4, 2, dtype=torch.float64)
    for kwargs, says in ((dict(mode="ring", head_group=1), "mode='all_gather'"),
                         (dict(head_group=1, dropout_p=0.1), "dropout"),
                         (dict(head_group=0), "head_group must be an int >= 1"),
                         (dict(head_group=True), "head_group must be an int >= 1")):
        try:
            context_parallel_attention(x, x, x, max_distance=1, **kwargs)
            fails.append(f"head_group {kwargs} was not refused")
        except ValueError as e:
            if says not in str(e):
                fails.append(f"head_group {kwargs}: unclear error {e}")
    # Round trip of values (with gradient), labels and a padding mask, both layouts.
    for layout in ("contiguous", "head_tail"):
        n = 4 * world
        full = torch.arange(2 * n * 3, dtype=torch.float64).reshape(2, n, 3)
        mine = shard_sequence(full, dim=1, layout=layout).requires_grad_()
        back = unshard_sequence(mine, dim=1, layout=layout)
        if not torch.equal(back, full):
            fails.append(f"round trip ({layout}) changed the tensor")
        back.sum().backward()
        if not torch.equal(mine.grad, torch.full_like(mine, float(world))):
            fails.append(f"unshard backward ({layout}): not the summed gradient")
        labels = torch.arange(n)
        if not torch.equal(unshard_sequence(shard_sequence(labels, dim=0, layout=layout),
                                            dim=0, layout=layout), labels):
            fails.append(f"labels round trip ({layout})")
        pad = torch.arange(n)[None, :] % 3 == 0
        if not torch.equal(unshard_sequence(shard_sequence(pad, dim=-1, layout=layout),
                                            dim=-1, layout=layout), pad):
            fails.append(f"padding mask round trip ({layout})")
    return fails


def _reduced_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        out[name] = g
    return out


def module_cases(rank: int, world: int) -> list[str]:
    """A relpos LM and a torch.nn.TransformerEncoder of relpos layers under
    context_parallel(...) equal the whole-sequence model: outputs and reduced gradients, with
    attention dropout (keyed by global positions) and a padding mask."""
    import copy

    from relpos.models import ModelConfig, RelativeTransformerLM
    from relpos.modules import RelativeMultiheadAttention, RelativeTransformerEncoderLayer

    fails: list[str] = []
    for mode, layout in itertools.product(("all_gather", "ring"), ("contiguous", "head_tail")):
        n = 6 * world
        torch.manual_seed(0)
        lm = RelativeTransformerLM(ModelConfig(vocab_size=11, d_model=8, num_layers=2,
                                               num_heads=2, max_distance=(3, 2))).double()
        for m in lm.modules():  # attention dropout only: other dropouts draw per shard
            if isinstance(m, RelativeMultiheadAttention):
                m.dropout = 0.2
        lm.train()
        ids = torch.randint(0, 11, (2, n), generator=torch.Generator().manual_seed(1))
        sharded = copy.deepcopy(lm)
        context_parallel(sharded, layout=layout, mode=mode)
        torch.manual_seed(5)
        whole = lm(ids)
        w = torch.randn(whole.shape, generator=torch.Generator().manual_seed(2),
                        dtype=torch.float64)
        (whole * w).sum().backward()
        torch.manual_seed(5)
        mine = sharded(shard_sequence(ids, dim=1, layout=layout))
        (mine * shard_sequence(w, dim=1, layout=layout)).sum().backward()
        _close(f"LM {mode} {layout}: logits", mine.detach(),
               shard_sequence(whole.detach(), dim=1, layout=layout), fails)
        reduced = _reduced_grads(sharded)
        for name, p in lm.named_parameters():
            _close(f"LM {mode} {layout}: d {name}", reduced[name], p.grad, fails)

        layer = RelativeTransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                                max_distance=2).double()
        encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        cp_encoder = copy.deepcopy(encoder)
        # head_group=1 (a head at a time, re-gathered in the backward) in one of the cases
        grouped = 1 if mode == "all_gather" and layout == "head_tail" else None
        context_parallel(cp_encoder, layout=layout, mode=mode, head_group=grouped)
        x = torch.randn(2, n, 8, generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)
        padding = torch.zeros(2, n, dtype=torch.bool)
        padding[1, n - 5:] = True
        whole = encoder(x, src_key_padding_mask=padding)
        whole.sum().backward()
        mine = cp_encoder(shard_sequence(x, dim=1, layout=layout),
                          src_key_padding_mask=shard_sequence(padding, dim=1, layout=layout))
        mine.sum().backward()
        _close(f"encoder {mode} {layout}: out", mine.detach(),
               shard_sequence(whole.detach(), dim=1, layout=layout), fails)
        reduced = _reduced_grads(cp_encoder)
        for name, p in encoder.named_parameters():
            _close(f"encoder {mode} {layout}: d {name}", reduced[name], p.grad, fails)
    return fails


def traffic_cases(rank: int, world: int) -> list[str]:
    """The calls and bytes of one layer's attention, forward and backward, counted, against
    relpos.distributed.traffic (the formula of docs/scaling.md)."""
    from relpos.distributed import count_traffic, traffic

    fails: list[str] = []
    Bt, Ht, Dt, DVt, n_local = 2, 3, 4, 5, 6
    for mode, mask, dtype, head_group in [
            *itertools.product(("all_gather", "ring"), (False, True),
                               (torch.float64, torch.float32), (None,)),
            ("ring", True, torch.bfloat16, None), ("ring", False, torch.bfloat16, None),
            ("all_gather", True, torch.float64, 2), ("all_gather", False, torch.float32, 1)]:
        g = torch.Generator().manual_seed(7 + rank)
        q, k = (torch.randn(Bt, Ht, n_local, Dt, generator=g, dtype=dtype,
                            requires_grad=True) for _ in range(2))
        v = torch.randn(Bt, Ht, n_local, DVt, generator=g, dtype=dtype, requires_grad=True)
        key_mask = torch.ones(Bt, n_local, dtype=torch.bool) if mask else None
        tk = torch.randn(5, Dt, dtype=dtype, requires_grad=True)
        with count_traffic(world) as fwd:
            out = context_parallel_attention(q, k, v, group=None, max_distance=2, rel_keys=tk,
                                             is_causal=True, key_mask=key_mask, mode=mode,
                                             head_group=head_group)
        with count_traffic(world) as bwd:
            out.square().sum().backward()
        want = traffic(mode, world=world, batch=Bt, heads=Ht, n_local=n_local, head_dim=Dt,
                       value_dim=DVt, key_mask=mask, dtype=dtype, backend="gloo",
                       head_group=head_group)
        got = (fwd.calls, bwd.calls, fwd.bytes, bwd.bytes)
        expected = (want.forward_calls, want.backward_calls, want.forward_bytes,
                    want.backward_bytes)
        if got != expected:
            fails.append(f"traffic {mode} mask={mask} {dtype} head_group={head_group}: "
                         f"counted {got}, formula "
                         f"{expected}")
        if dtype == torch.bfloat16:  # sent as bfloat16, computed as on float32 copies
            wide = [t.detach().float().requires_grad_() for t in (q, k, v, tk)]
            out32 = context_parallel_attention(*wide[:3], group=None, max_distance=2,
                                               rel_keys=wide[3], is_causal=True,
                                               key_mask=key_mask, mode=mode)
            out32.to(dtype).float().square().sum().backward()
            pairs = [("out", out, out32), *(
                (f"d{name}", mine.grad, w.grad) for name, mine, w in
                zip(("q", "k", "v", "rel_keys"), (q, k, v, tk), wide, strict=True))]
            for name, mine, want in pairs:
                if not torch.equal(mine, want.to(dtype)):
                    fails.append(f"ring bfloat16 mask={mask}: {name} differs from the call on "
                                 f"float32 copies")
    return fails


def disagreements(rank: int, world: int) -> list[tuple[str, dict[str, object], list[str]]]:
    """(what, this rank's arguments, what every rank's error must say): ranks that differ
    in one option (rank 0 against the others)."""
    first = rank == 0
    g = torch.Generator().manual_seed(11)
    shared = torch.randn(4, D, generator=g, dtype=torch.float64)  # K=(2, 1): 4 rows
    per_head = torch.randn(H, 4, D, generator=g, dtype=torch.float64)
    return [
        ("layout", dict(layout="head_tail" if first else "contiguous"),
         ["disagree on layout: rank 0 'head_tail', rank 1 'contiguous'"]),
        ("mode", dict(mode="ring" if first else "all_gather"),
         ["disagree on mode: rank 0 'ring', rank 1 'all_gather'"]),
        ("head_group", dict(head_group=1 if first else None),
         ["disagree on head_group: rank 0 1, rank 1 None"]),
        ("is_causal", dict(is_causal=first), ["disagree on is_causal: rank 0 True, rank 1 False"]),
        ("max_distance", dict(max_distance=(2, 1) if first else (1, 2)),
         ["disagree on max_distance: rank 0 (2, 1), rank 1 (1, 2)"]),
        ("scale", dict(scale=None if first else 0.5),
         ["disagree on scale: rank 0 None", "rank 1 0.5"]),
        ("table shapes", dict(rel_keys=shared if first else per_head),
         [f"disagree on rel_keys: rank 0 (4, {D}), rank 1 ({H}, 4, {D})"]),
        ("table present", dict(rel_values=None if first else shared[:, :DV]),
         [f"disagree on rel_values: rank 0 None, rank 1 (4, {DV})"]),
        ("dropout_p", dict(dropout_p=0.25 if first else 0.0, mode="ring"),
         ["disagree on dropout_p: rank 0 0.25, rank 1 0.0"]),
        ("gradients", dict(grad=first),
         ["disagree on requires_grad", "rank 0 key/value", "rank 1 none"]),
        # Arguments only rank 0 refuses: its own error there, the others name it.
        ("refused on rank 0", dict(mode="ring", head_group=1 if first else None),
         ["head_group bounds what mode='all_gather' gathers"]),
    ]


def mismatch_cases(rank: int, world: int, only: list[str]) -> list[str]:
    """Ranks that disagree on an option: every rank raises one ValueError naming the option
    and each rank's value (no hang, no abort, no rows), and the group still works after."""
    fails: list[str] = []
    g = torch.Generator().manual_seed(rank)
    for what, kwargs, says in disagreements(rank, world):
        if only and what not in only:
            continue
        q, k, v = (torch.randn(1, H, 4, d, generator=g, dtype=torch.float64)
                   for d in (D, D, DV))
        args: dict[str, object] = {"max_distance": (2, 1), **kwargs}
        if args.pop("grad", False):
            k.requires_grad_()
        try:
            context_parallel_attention(q, k, v, **args)  # type: ignore[arg-type]
            outcome = "returned"
        except ValueError as e:
            outcome = str(e)
        except Exception as e:  # a collective out of step (timeout): stop here
            return [*fails, f"ranks that disagree on {what}: raised {type(e).__name__}: {e}"]
        outcomes: list[str] = [""] * world
        dist.all_gather_object(outcomes, outcome)
        if not all(s in outcome for s in says):
            fails.append(f"ranks that disagree on {what}: {outcome}")
        elif not what.startswith("refused") and len(set(outcomes)) > 1:
            fails.append(f"ranks that disagree on {what}: different errors {outcomes}")
    # unshard_sequence alike: the layout (the shapes match, the order would not).
    if not only:
        try:
            unshard_sequence(torch.arange(4), dim=0,
                             layout="head_tail" if rank == 0 else "contiguous")
            fails.append("unshard_sequence: ranks that disagree on layout were not refused")
        except ValueError as e:
            if "unshard_sequence: the ranks disagree on layout: rank 0 'head_tail', rank 1 " \
                    "'contiguous'" not in str(e):
                fails.append(f"unshard_sequence, layouts that differ: unclear error {e}")
    # Still in step: a call that all ranks agree on equals the single-process call.
    n = 4 * world
    x = torch.randn(1, H, n, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = relative_attention(x, x, x, max_distance=1, is_causal=True)
    mine = shard_sequence(x, dim=2)
    _close("after the refusals", context_parallel_attention(
        mine, mine, mine, max_distance=1, is_causal=True), shard_sequence(want, dim=2), fails)
    return fails


def equal_one_process(rank: int, world: int) -> list[str]:
    fails: list[str] = []
    for case in cases(world):
        try:
            fails += [f"{case}: {f}" for f in run_case(rank, world, **case)]  # type: ignore[arg-type]
        except Exception:
            fails.append(f"{case}: raised\n{traceback.format_exc()}")
            return fails  # the ranks may be out of step now: stop before a collective hangs
    return fails + refusals(rank, world) + module_cases(rank, world) + traffic_cases(rank, world)


def main() -> int:
    """``RANK WORLD PORT``: every case against one process; ``... mismatch [WHAT...]``: ranks
    that disagree (only the options named, if any)."""
    rank, world, port = (int(a) for a in sys.argv[1:4])
    torch.set_num_threads(1)
    mismatches = sys.argv[4:5] == ["mismatch"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=20 if mismatches else 60))
    try:
        fails = (mismatch_cases(rank, world, sys.argv[5:]) if mismatches
                 else equal_one_process(rank, world))
    finally:
        dist.destroy_process_group()
    for f in fails:
        print(f"FAIL rank {rank}: {f}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
