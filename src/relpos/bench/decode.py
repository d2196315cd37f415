"""Decode benchmark: one KV-cache attention step against plain SDPA over the same cache.

``relpos bench --decode`` calls :func:`run_decode`. For every cache length ``S`` and step
size ``t`` (1 = one generated token, 64 = a prefill chunk) it times the attention step alone:
``t`` new queries attending (causally, aligned to the end) over ``S`` cached keys/values with
the relative tables, against ``F.scaled_dot_product_attention`` with the same q/k/v and the
same bottom-right causal mask but no relative terms. Methods run interleaved (one call of
each per round, :func:`relpos.bench.common.interleaved_medians`) after a warm-up; the median
of the rounds is reported, with the ratio to SDPA measured in the same rounds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.bench import common

__all__ = ["DecodeResult", "measure_step", "run_decode", "settings"]

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 1024)
DEFAULT_STEPS = (1, 64)
DEFAULT_MAX_DISTANCES = (64,)


@dataclass
class DecodeResult:
    """Median times (ms) of one configuration; ``ms`` maps method name -> median ms.

    Attributes:
        S: cache length after the step.
        t: new tokens in the step.
        K: clip distance.
        backend: the backend ``relative_attention(implementation=None)`` picked.
        ms: method (``"sdpa"``, ``"relpos"`` and each named backend) -> median ms.
    """

    S: int
    t: int
    K: int
    backend: str
    ms: dict[str, float]

    def ratio(self, method: str) -> float:
        """Median time of ``method`` over that of SDPA."""
        return self.ms[method] / self.ms["sdpa"]


def measure_step(
    S: int,
    t: int,
    *,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    max_distance: int = 64,
    dtype: torch.dtype = torch.float32,
    repeats: int = 15,
    warmup: int = 3,
    backends: Sequence[str] = (),
    seed: int = 0,
) -> DecodeResult:
    """Time one decode step of ``t`` queries over ``S`` cached keys (``t <= S``).

    The step's query is ``(B, H, t, D)``; keys and values are ``(B, H, S, D)`` views of a
    :class:`relpos.cache.LayerCache`; the tables are ``(2K + 1, D)``.

    Args:
        S: cache length after the step (the step's own ``t`` keys included).
        t: new tokens in the step.
        batch, heads, head_dim: B, H, D.
        max_distance: K.
        dtype: tensor dtype.
        repeats: measured rounds (median reported).
        warmup: unmeasured rounds first.
        backends: backends to time by name besides ``relpos`` (auto) and ``sdpa``.
        seed: seeds the random inputs.

    Returns:
        A :class:`DecodeResult` with the median milliseconds of ``sdpa``, ``relpos`` and each
        named backend.

    Raises:
        ValueError: if ``t > S``.
    """
    from relpos.cache import LayerCache
    from relpos.functional import relative_attention, select_backend

    if t > S:
        raise ValueError(f"step t={t} larger than the cache length S={S}")
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    B, H, D, K = batch, heads, head_dim, max_distance
    cache = LayerCache(capacity=S, growable=False)
    if t < S:
        cache.append(rnd(B, H, S - t, D), rnd(B, H, S - t, D))
    k, v, _ = cache.append(rnd(B, H, t, D), rnd(B, H, t, D))  # (B, H, S, D) views
    q = rnd(B, H, t, D)
    ak, av = rnd(2 * K + 1, D), rnd(2 * K + 1, D)
    mask = torch.ones(t, S, dtype=torch.bool).tril(S - t) if t > 1 else None  # bottom-right
    rel: dict[str, Any] = {"max_distance": K, "rel_keys": ak, "rel_values": av, "is_causal": True}

    methods: dict[str, Sequence[Callable[[], object]]] = {
        "sdpa": [lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)],
        "relpos": [lambda: relative_attention(q, k, v, **rel)],
    }
    for name in backends:
        methods[name] = [functools.partial(
            relative_attention, q, k, v, implementation=name, **rel  # type: ignore[arg-type]
        )]
    with torch.inference_mode():
        medians, _ = common.interleaved_medians(methods, warmup=warmup, repeats=repeats)
    return DecodeResult(
        S=S, t=t, K=K, backend=select_backend(q, k, v, **rel),
        ms={name: ms for name, (ms,) in medians.items()},
    )


def _ints(value: object, default: Sequence[int], name: str, minimum: int = 1) -> list[int]:
    """``value`` (None, an int, a comma-separated string or a sequence) as a list of ints
    >= ``minimum``; ``default`` when None."""
    if value is None:
        return list(default)
    if isinstance(value, int) and not isinstance(value, bool):
        items: list[object] = [value]
    elif isinstance(value, str):
        items = [x for x in value.replace(",", " ").split() if x]
    else:
        items = list(value)  # type: ignore[call-overload]
    out = []
    for x in items:
        try:
            n = int(x)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise ValueError(f"--{name} must be integers, got {x!r}") from None
        if n < minimum:
            raise ValueError(f"--{name} must be {'positive' if minimum else '>= 0'}, got {n}")
        out.append(n)
    if not out:
        raise ValueError(f"--{name} needs at least one value")
    return out


def _output_paths(out: object) -> tuple[Path, Path] | None:
    """(markdown, csv) for ``--out``: a directory, or a ``.md``/``.csv`` path."""
    if out is None or out == "":
        return None
    md, csv = common.report_files(str(out), "decode", file_ok=True)
    return md, csv


@dataclass
class _Settings:
    """The resolved settings of one decode benchmark run."""

    lengths: list[int]
    steps: list[int]
    max_distances: list[int]
    heads: int
    head_dim: int
    batch: int
    repeats: int
    warmup: int
    dtype: str
    extra: list[str]

    def command(self, threads: int, out: object) -> str:
        """The ``relpos bench --decode`` command with every setting spelled out."""
        return (
            f"relpos bench --decode --lengths {','.join(map(str, self.lengths))} "
            f"--steps {','.join(map(str, self.steps))} "
            f"--max-distances {','.join(map(str, self.max_distances))} --batch {self.batch} "
            f"--heads {self.heads} --head-dim {self.head_dim} --dtype {self.dtype} "
            f"--repeats {self.repeats} --warmup {self.warmup} --threads {threads}"
            + (f" --backends {','.join(self.extra)}" if self.extra else "")
            + (f" --out {out}" if out else "")
        )


def settings(args: Any) -> _Settings:
    """The run ``relpos bench --decode`` options ask for (see :func:`run_decode`), checked.

    Raises:
        ValueError: on a setting out of range or an unknown backend.
    """
    from relpos.functional import available_backends

    quick = bool(getattr(args, "quick", False))  # a small smoke run
    warmup = getattr(args, "warmup", None)
    warmup = (1 if quick else 3) if warmup is None else int(warmup)
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    dtype = common.check_dtype(getattr(args, "dtype", None))
    requested = getattr(args, "backends", None)
    available = available_backends()
    extra = (
        # triton is a GPU backend (python -m relpos.bench.cuda_check --triton times it)
        [b for b in available if b not in ("reference", "triton")] if requested is None
        else list(common.check_backends(requested, available))
    )
    return _Settings(
        lengths=_ints(getattr(args, "lengths", None),
                      QUICK_LENGTHS if quick else DEFAULT_LENGTHS, "lengths"),
        steps=_ints(getattr(args, "steps", None), DEFAULT_STEPS, "steps"),
        max_distances=_ints(
            getattr(args, "max_distances", None) or getattr(args, "max_distance", None),
            DEFAULT_MAX_DISTANCES, "max-distances", minimum=0,
        ),
        heads=_ints(getattr(args, "heads", None), (8,), "heads")[0],
        head_dim=_ints(getattr(args, "head_dim", None), (64,), "head-dim")[0],
        batch=_ints(getattr(args, "batch", None), (1,), "batch")[0],
        repeats=_ints(getattr(args, "repeats", None), (3,) if quick else (15,), "repeats")[0],
        warmup=warmup,
        dtype=dtype,
        extra=extra,
    )


def run_decode(args: Any) -> int:
    """Run the decode benchmark from an argparse namespace (every attribute optional).

    Attributes read (``getattr`` with defaults): ``lengths`` (cache lengths S, default
    512..16384), ``steps`` (t values, default 1 and 64), ``heads`` (8), ``head_dim`` (64),
    ``batch`` (1), ``max_distances`` (K values, default 64), ``repeats`` (15), ``warmup`` (3),
    ``dtype`` ("float32"), ``threads`` (torch's default), ``backends`` (extra backends to
    time by name; default every available one except ``reference``), ``out`` (a directory
    for ``decode.md``/``decode.csv``, or a ``.md`` path; None = print only), ``quick`` (a
    smoke run: S = 512, 1024, 1 warm-up, 3 rounds). Lists may be given as sequences or as
    comma-separated strings.

    Returns:
        0 (the exit status).

    Raises:
        ValueError: on a setting out of range or an unknown backend.
    """
    cfg = settings(args)
    common.use_threads(getattr(args, "threads", None))
    paths = _output_paths(getattr(args, "out", None))

    results: list[DecodeResult] = []
    methods = ["sdpa", "relpos", *cfg.extra]
    header = f"{'K':>4} {'t':>3} {'S':>6} {'auto':>9} " + " ".join(
        f"{m + ' ms':>13}" for m in methods
    ) + " " + " ".join(f"{m + '/sdpa':>14}" for m in methods[1:])
    print(header, flush=True)
    for K in cfg.max_distances:
        for t in cfg.steps:
            for S in cfg.lengths:
                if t > S:
                    continue
                r = measure_step(
                    S, t, batch=cfg.batch, heads=cfg.heads, head_dim=cfg.head_dim,
                    max_distance=K, dtype=getattr(torch, cfg.dtype), repeats=cfg.repeats,
                    warmup=cfg.warmup, backends=cfg.extra,
                )
                results.append(r)
                print(
                    f"{K:>4} {t:>3} {S:>6} {r.backend:>9} "
                    + " ".join(f"{r.ms[m]:>13.3f}" for m in methods)
                    + " "
                    + " ".join(f"{r.ratio(m):>14.2f}" for m in methods[1:]),
                    flush=True,
                )

    if paths is not None:
        threads_now = torch.get_num_threads()
        meta = {
            "date": common.report_date(),
            **common.environment(threads_now),
            "dtype": cfg.dtype,
            "shape": f"B={cfg.batch}, H={cfg.heads}, D={cfg.head_dim}",
            "repeats": f"{cfg.repeats} measured rounds after {cfg.warmup} warm-up rounds (median)",
            "command": common.typed_command(args)
            or cfg.command(threads_now, getattr(args, "out", None)),
        }
        md_path, csv_path = paths
        common.write_files({
            csv_path: _csv(results, methods),
            md_path: _markdown(results, methods, meta, csv_path.name),
        })
        print(f"wrote {md_path} and {csv_path}")
    return 0


def _csv(results: list[DecodeResult], methods: list[str]) -> str:
    return common.csv_text(
        ["K", "t", "S", "auto_backend", *(f"{m}_ms" for m in methods),
         *(f"{m}_over_sdpa" for m in methods[1:])],
        ([r.K, r.t, r.S, r.backend, *(f"{r.ms[m]:.4f}" for m in methods),
          *(f"{r.ratio(m):.3f}" for m in methods[1:])] for r in results),
    )


def _markdown(
    results: list[DecodeResult], methods: list[str], meta: dict[str, str], csv_name: str
) -> str:
    lines = [
        "# Decode step: relative attention over a KV cache vs plain SDPA",
        "",
        "One attention step: `t` new queries attend causally (aligned to the end) over `S`",
        "cached keys/values (the step's own keys included) with clipped relative key and value",
        "tables (`relpos`, `implementation=None`, the backend it picks in column `auto`),",
        "against `F.scaled_dot_product_attention` with the same q/k/v and the same",
        "bottom-right causal mask but no relative terms. Median over interleaved rounds;",
        "ratios are to SDPA in the same rounds.",
        "",
        *common.markdown_meta(meta),
        "",
        f"Raw numbers: [`{csv_name}`]({csv_name}).",
        "",
    ]
    head = ["K", "t", "S", "auto", *(f"{m} ms" for m in methods),
            *(f"{m}/sdpa" for m in methods[1:])]
    rows = ([str(r.K), str(r.t), str(r.S), r.backend, *(f"{r.ms[m]:.3f}" for m in methods),
             *(f"{r.ratio(m):.2f}" for m in methods[1:])] for r in results)
    lines += common.markdown_table(head, rows, align="---:")
    lines.append("")
    return "\n".join(lines)
