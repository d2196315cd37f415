"""``relpos bench --preset encoder``: a training step of a 6-layer Transformer encoder built
from relpos's :class:`~relpos.modules.transformer_layers.RelativeTransformerEncoderLayer`, against
the same model built from ``nn.TransformerEncoderLayer``.

The two models (:func:`build_models`) are alike but for the attention: 6 layers of E=512,
H=8 (D=64), FF=2048, ReLU, dropout 0, ``batch_first=True``, ``norm_first=True`` (pre-norm,
how Transformers are trained today), stacked in ``nn.TransformerEncoder`` with a final
``LayerNorm`` (as pre-norm stacks end) and ``enable_nested_tensor=False``; relpos's layers add
``max_distance=K`` (K=16) with keys and values tables shared by the heads, ``2 (2K + 1) D``
parameters per layer. The relpos model starts from the torch model's weights (its state dict
loads with only the tables missing), so with zero tables both compute the same function.

Timed at B x n = 32x128 and 8x512 (4096 tokens; ``--lengths`` and ``--tokens`` choose other
shapes of :func:`relpos.bench.presets.token_shapes`): the forward (the models in train mode,
under ``torch.no_grad``: torch's inference fast path, which needs eval mode, is off for both,
so both run the same operations) and the forward + backward (gradients reset to None, then
the backward of a fixed random upstream gradient ``g``: ``loss = sum(out * g)``, which unlike
``out.sum()`` does not vanish through the final ``LayerNorm``). No optimizer step: it is the
same elementwise update of the same weights in both models (plus the small tables), so it
would add the same time to both and only dilute the ratio. Models run in the same
interleaved rounds, medians reported.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from relpos.bench import attention, common, presets

__all__ = [
    "EncoderResult",
    "EncoderSettings",
    "build_models",
    "encoder_settings",
    "relative_table_count",
    "run_encoder",
]

LAYERS = 6
D_MODEL = 512
NHEAD = 8
DIM_FEEDFORWARD = 2048
NORM_FIRST = True
DEFAULT_LENGTHS = (128, 512)
DEFAULT_MAX_DISTANCES = (16,)
QUICK_TOKENS = 512
QUICK_LENGTHS = (64,)
#: What ``--backends`` may name with ``--preset encoder``: the relpos layers' implementation
#: (``auto`` = None). The torch model always runs.
IMPLEMENTATIONS = ("auto", "native", "flash_regions", "bucketed", "reference")
TORCH = "nn.TransformerEncoderLayer"


def build_models(
    max_distance: int,
    implementations: Sequence[str] = ("auto",),
    *,
    layers: int = LAYERS,
    d_model: int = D_MODEL,
    nhead: int = NHEAD,
    dim_feedforward: int = DIM_FEEDFORWARD,
    norm_first: bool = NORM_FIRST,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.TransformerEncoder, dict[str, nn.TransformerEncoder]]:
    """The torch encoder and, for each implementation, its relpos twin (train mode).

    Args:
        max_distance: K of the relpos layers.
        implementations: the relpos layers' backends (``"auto"`` = None), one model each.
        layers, d_model, nhead, dim_feedforward, norm_first: the architecture (E, H, FF).
        dtype: the parameters' dtype.
        seed: seeds the initialization (the global RNG is left as it was).

    Returns:
        ``(torch_model, {implementation: relpos_model})``; every relpos model holds the torch
        model's weights and the same tables.

    Example:
        >>> plain, rel = build_models(4, layers=2, d_model=16, nhead=2, dim_feedforward=32)
        >>> x = torch.randn(3, 10, 16)
        >>> plain(x).shape == rel["auto"](x).shape == x.shape
        True
    """
    from relpos.modules.transformer_layers import RelativeTransformerEncoderLayer

    layer_args: dict[str, Any] = dict(
        d_model=d_model, nhead=nhead, dim_feedforward=dim_feedforward, dropout=0.0,
        batch_first=True, norm_first=norm_first,
    )

    def stack(layer: Any) -> nn.TransformerEncoder:  # torch's layer or relpos's drop-in
        return nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model),
                                     enable_nested_tensor=False)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        plain = stack(nn.TransformerEncoderLayer(**layer_args))
        tables: dict[str, Tensor] = {}
        relative: dict[str, nn.TransformerEncoder] = {}
        for impl in implementations:
            model = stack(RelativeTransformerEncoderLayer(
                **layer_args, max_distance=max_distance,
                implementation=None if impl == "auto" else impl,  # type: ignore[arg-type]
            ))
            missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
            assert not unexpected and all(k.endswith(("rel_keys", "rel_values")) for k in missing)
            if tables:  # the same tables in every relpos model
                model.load_state_dict(tables, strict=False)
            else:
                tables = {k: v for k, v in model.state_dict().items() if k in missing}
            relative[impl] = model.to(dtype).train()
    return plain.to(dtype).train(), relative


def relative_table_count(model: nn.Module) -> int:
    """The parameters of ``model``'s relative tables (``rel_keys``, ``rel_values``)."""
    return sum(p.numel() for name, p in model.named_parameters()
               if name.endswith(("rel_keys", "rel_values")))


def _parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class EncoderSettings(presets.TokenSweep):
    """One ``--preset encoder`` run, resolved from the options."""

    implementations: list[str]

    def command(self, threads: int, out: str | None) -> str:
        """The ``relpos bench --preset encoder`` command with every setting spelled out."""
        return (
            f"relpos bench --preset encoder {self.sweep_options()} {self.timing_options()} "
            f"--backends {','.join(self.implementations)} --threads {threads}"
            + (f" --out {out}" if out else "")
        )


def encoder_settings(args: argparse.Namespace) -> EncoderSettings:
    """The run the ``relpos bench --preset encoder`` options ask for, read as
    :func:`relpos.bench.presets.training_settings` reads them (with this preset's defaults),
    checked.

    Raises:
        ValueError: on an unknown implementation or a setting out of range.
    """
    quick = bool(getattr(args, "quick", False))
    tokens = int(getattr(args, "tokens", None) or (QUICK_TOKENS if quick
                                                   else presets.DEFAULT_TOKENS))
    backends = getattr(args, "backends", None)
    return EncoderSettings(
        **presets.read_sweep(args, tokens=tokens,
                             lengths=QUICK_LENGTHS if quick else DEFAULT_LENGTHS,
                             max_distances=DEFAULT_MAX_DISTANCES),
        implementations=(["auto"] if backends is None
                         else list(common.check_backends(backends, IMPLEMENTATIONS))),
    )


# ----------------------------------------------------------------------------------------------
# Running


@dataclass
class EncoderResult:
    """One model at one shape: ``K`` and ``implementation`` None for the torch model; ``ms``
    maps each pass of :data:`relpos.bench.presets.PASSES` to its median ms (empty when it
    did not run: ``note`` says why); ``backend`` is the one relpos's attention runs (for
    ``implementation="auto"``, the one :func:`relpos.select_backend` names)."""

    B: int
    n: int
    K: int | None
    implementation: str | None
    backend: str = ""  # for the forward + backward
    forward_backend: str = ""  # for the forward, under torch.no_grad
    ms: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def name(self) -> str:
        """The model's column in the report."""
        return TORCH if self.K is None else f"relpos K={self.K} {self.implementation}"


def _forward(model: nn.Module, x: Tensor) -> None:
    with torch.no_grad():
        model(x)


def _forward_backward(model: nn.Module, x: Tensor, grad: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).backward(grad)


def _picked(B: int, n: int, K: int, model: nn.TransformerEncoder, dtype: torch.dtype) -> str:
    """The backend relpos's attention runs in ``model`` at this shape (``implementation``
    None)."""
    from relpos.functional import select_backend

    attn: Any = model.layers[0].self_attn
    q = torch.empty(B, attn.num_heads, n, attn.head_dim, dtype=dtype)  # (B, H, n, D)
    return select_backend(q, q, q, max_distance=K, rel_keys=attn.rel_keys,
                          rel_values=attn.rel_values)


def run_encoder(args: argparse.Namespace) -> int:
    """Run ``relpos bench --preset encoder`` (the options :func:`encoder_settings` reads, plus
    ``threads`` and ``out``): print the table, write ``encoder.md`` and ``encoder.csv`` into
    ``args.out`` when it is set, and return 0 (the exit status)."""
    s = encoder_settings(args)
    threads = common.use_threads(getattr(args, "threads", None))
    dtype = getattr(torch, s.dtype)
    clock = common.RunClock()
    # The module's constants, read now (the defaults of build_models were read at import).
    architecture: dict[str, Any] = dict(
        layers=LAYERS, d_model=D_MODEL, nhead=NHEAD, dim_feedforward=DIM_FEEDFORWARD,
        norm_first=NORM_FIRST, dtype=dtype,
    )
    plain, _ = build_models(0, (), **architecture)
    relative = {K: build_models(K, s.implementations, **architecture)[1]
                for K in s.max_distances}
    tables = {K: relative_table_count(next(iter(models.values())))
              for K, models in relative.items()}
    tick, close = attention.progress(
        len(s.shapes) * (1 + len(s.max_distances) * len(s.implementations))
        * (s.warmup + s.repeats))
    results: list[EncoderResult] = []
    try:
        for B, n in s.shapes:
            results += _run_shape(B, n, s, plain, relative, tick)
    finally:
        close()
    table = _table(results, s)
    print("\n".join(table))
    out = getattr(args, "out", None)
    if out:
        counts = ", ".join(f"K={K}: {_parameter_count(plain):,} + {tables[K]:,} in the tables"
                           for K in s.max_distances)
        meta = {
            **common.command_header(args, s.command(threads, out), threads),
            "model": f"nn.TransformerEncoder of {LAYERS} layers (E={D_MODEL}, H={NHEAD}, "
                     f"FF={DIM_FEEDFORWARD}, ReLU, dropout 0, batch_first=True, "
                     f"norm_first={NORM_FIRST}) and a final LayerNorm, "
                     "enable_nested_tensor=False; torch's layers against "
                     "relpos.RelativeTransformerEncoderLayer(..., max_distance=K) with the "
                     f"same weights, keys and values tables shared by the heads; {s.dtype}",
            "parameters": f"torch {_parameter_count(plain):,}; relpos {counts}",
            "shapes": f"{s.tokens} tokens per batch: B = {s.tokens} // n, input (B, n, E)",
            "step": "fwd = forward (train mode, dropout 0, under torch.no_grad(); torch's "
                    "inference fast path is off for both); fwd+bwd = gradients set to None, "
                    "forward, backward of a fixed random upstream gradient (loss = "
                    "sum(out * g)); no optimizer step (the same update for both models)",
            "timing": f"{s.warmup} warm-up round(s), then the median of {s.repeats} rounds; a "
                      "round runs every model of one shape in turn (interleaved; the order "
                      "rotated by one model each round), forward then forward + backward",
            **clock.meta(),
        }
        md, csv = common.report_files(out, "encoder")
        common.write_files({md: _markdown(table, meta, csv.name), csv: _csv(results)})
        print(f"wrote {md} and {csv}")
    return 0


def _run_shape(
    B: int, n: int, s: EncoderSettings, plain: nn.Module,
    relative: dict[int, dict[str, nn.TransformerEncoder]], tick: Callable[[str], None],
) -> list[EncoderResult]:
    """Every model at one shape, timed in the same interleaved rounds."""
    dtype = getattr(torch, s.dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, n, D_MODEL, generator=g).to(dtype)  # (B, n, E)
    grad = torch.randn(B, n, D_MODEL, generator=g).to(dtype)  # (B, n, E)
    results = [EncoderResult(B, n, None, None)]
    models: list[nn.Module] = [plain]
    for K, by_impl in relative.items():
        for impl, model in by_impl.items():
            r = EncoderResult(B, n, K, impl, backend=(
                _picked(B, n, K, model, dtype) if impl == "auto" else impl))
            with torch.no_grad():  # auto-selection weighs whether a backward follows
                r.forward_backend = _picked(B, n, K, model, dtype) if impl == "auto" else impl
            r.note = presets.reference_skip(impl, n)
            results.append(r)
            models.append(model)
    calls = {
        i: [functools.partial(_forward, model, x),
            functools.partial(_forward_backward, model, x, grad)]
        for i, (r, model) in enumerate(zip(results, models, strict=True)) if not r.note
    }

    presets.time_passes(calls, results, f"{B}x{n}", [r.name for r in results], s.warmup,
                        s.repeats, tick)
    for timed in models:
        timed.zero_grad(set_to_none=True)  # free the gradients before the next shape
    return results


# ----------------------------------------------------------------------------------------------
# Reporting


def _table(results: list[EncoderResult], s: EncoderSettings) -> list[str]:
    """A markdown table: a row per shape and pass; the torch model's median ms, each relpos
    model's and its ratio to the torch model, the backend auto picks."""
    names = [TORCH] + [f"relpos K={K} {impl}" for K in s.max_distances
                       for impl in s.implementations]
    found = {(r.B, r.n, r.name): r for r in results}
    rows = []
    for B, n in s.shapes:
        base = found[(B, n, TORCH)]
        for pass_ in presets.PASSES:
            picks = ", ".join(
                f"K={r.K}: {r.forward_backend if pass_ == presets.PASSES[0] else r.backend}"
                for r in results if (r.B, r.n) == (B, n) and r.implementation == "auto"
            ) or "-"
            floor = base.ms.get(pass_)
            cells = []
            for name in names:
                r = found[(B, n, name)]
                if pass_ not in r.ms:
                    cells.append(r.note or "-")
                elif r.K is None or not floor:
                    cells.append(f"{common.format_ms(r.ms[pass_])} ms")
                else:
                    cells.append(f"{common.format_ms(r.ms[pass_])} ms "
                                 f"({r.ms[pass_] / floor:.2f}x)")
            rows.append([f"{B} x {n}", pass_, *cells, picks])
    return common.markdown_table(["B x n", "pass", *names, "auto picks"], rows)


def _markdown(table: list[str], meta: dict[str, str], csv_name: str) -> str:
    lines = [
        "# relpos encoder training step",
        "",
        f"A {LAYERS}-layer encoder built from relpos's RelativeTransformerEncoderLayer against "
        "the same model built from nn.TransformerEncoderLayer (same weights; relpos adds the "
        "relative tables). Each relpos cell is its median time and, in parentheses, its ratio "
        "to the torch model's in the same interleaved rounds.",
        "",
        *common.markdown_meta(meta),
        "",
        f"Raw numbers: [`{csv_name}`]({csv_name}).",
        "",
        *table,
        "",
    ]
    return "\n".join(lines)


def _csv(results: list[EncoderResult]) -> str:
    floors = {(r.B, r.n): r.ms for r in results if r.K is None}
    rows = []
    for r in results:
        for pass_ in presets.PASSES:
            ms, floor = r.ms.get(pass_), floors.get((r.B, r.n), {}).get(pass_)
            rows.append([
                r.B, r.n, "" if r.K is None else r.K, "torch" if r.K is None else "relpos",
                r.implementation or "",
                r.forward_backend if pass_ == presets.PASSES[0] else r.backend, pass_,
                "" if ms is None else f"{ms:.4g}",
                "" if ms is None or not floor else f"{ms / floor:.4g}", r.note,
            ])
    return common.csv_text(
        ["B", "n", "K", "model", "implementation", "attention_backend", "pass", "ms",
         "over_torch",
         "note"],
        rows,
    )
