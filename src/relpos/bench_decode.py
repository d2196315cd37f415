"""Decode benchmark: one KV-cache attention step against plain SDPA over the same cache.

``relpos bench --decode`` calls :func:`run_decode`. For every cache length ``S`` and step
size ``t`` (1 = one generated token, 64 = a prefill chunk) it times the attention step alone:
``t`` new queries attending (causally, aligned to the end) over ``S`` cached keys/values with
the relative tables, against ``F.scaled_dot_product_attention`` with the same q/k/v and the
same bottom-right causal mask but no relative terms. Methods run interleaved (one call of
each per round) after a warm-up; the median of the rounds is reported, with the ratio to
SDPA measured in the same rounds.
"""

from __future__ import annotations

import csv
import datetime
import io
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos._io import atomic_write_text
from relpos._sysinfo import hardware

__all__ = ["DecodeResult", "measure_step", "run_decode"]

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_STEPS = (1, 64)
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class DecodeResult:
    """Median times (ms) of one configuration; ``ms`` maps method name -> median ms."""

    S: int
    t: int
    K: int
    backend: str
    ms: dict[str, float]

    def ratio(self, method: str) -> float:
        return self.ms[method] / self.ms["sdpa"]


def _auto_backend(**kwargs: Any) -> str:
    """Name of the backend ``relative_attention(implementation=None)`` picks for this call."""
    from relpos import functional

    args = functional._validate(**kwargs)
    for name in functional._AUTO_ORDER:
        backend = functional._backend(name)
        if backend is None:
            continue
        chooser = getattr(backend, "auto_reason", backend.unsupported_reason)
        if chooser(**args) is None:
            return name
    return "reference"


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

    Args:
        S: cache length after the step (the step's own ``t`` keys included).
        t: new tokens in the step.
        batch, heads, head_dim: B, H, D.
        max_distance: K.
        dtype: tensor dtype.
        repeats: measured rounds (median reported).
        warmup: unmeasured rounds first.
        backends: backends to time by name besides ``relpos`` (auto) and ``sdpa``.

    Returns:
        A :class:`DecodeResult` with the median milliseconds of ``sdpa``, ``relpos`` and each
        named backend.
    """
    from relpos import relative_attention
    from relpos.cache import LayerCache

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
    rel = {"max_distance": K, "rel_keys": ak, "rel_values": av, "is_causal": True}

    methods: dict[str, Callable[[], Tensor]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "relpos": lambda: relative_attention(q, k, v, **rel),  # type: ignore[arg-type]
    }
    for name in backends:
        methods[name] = lambda name=name: relative_attention(  # type: ignore[misc]
            q, k, v, implementation=name, **rel  # type: ignore[arg-type]
        )
    times: dict[str, list[float]] = {name: [] for name in methods}
    with torch.inference_mode():
        for round_ in range(warmup + repeats):
            for name, fn in methods.items():
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                if round_ >= warmup:
                    times[name].append(elapsed * 1e3)
    backend = _auto_backend(
        query=q, key=k, value=v, max_distance=K, rel_keys=ak, rel_values=av, attn_mask=None,
        key_mask=None, is_causal=True, dropout_p=0.0, scale=None, query_start=None,
    )
    return DecodeResult(
        S=S, t=t, K=K, backend=backend, ms={n: statistics.median(x) for n, x in times.items()}
    )


def _ints(value: object, default: Sequence[int], name: str) -> list[int]:
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
        if n <= 0 and name != "max-distances":
            raise ValueError(f"--{name} must be positive, got {n}")
        if n < 0:
            raise ValueError(f"--{name} must be >= 0, got {n}")
        out.append(n)
    if not out:
        raise ValueError(f"--{name} needs at least one value")
    return out


def _output_paths(out: object) -> tuple[Path, Path] | None:
    if out is None or out == "":
        return None
    p = Path(str(out))
    if p.suffix.lower() == ".md":
        return p, p.with_suffix(".csv")
    if p.suffix.lower() == ".csv":
        return p.with_suffix(".md"), p
    return p / "decode.md", p / "decode.csv"


def run_decode(args: Any) -> int:
    """Run the decode benchmark from an argparse namespace (every attribute optional).

    Attributes read (``getattr`` with defaults): ``lengths`` (cache lengths S, default
    512..16384), ``steps`` (t values, default 1 and 64), ``heads`` (8), ``head_dim`` (64),
    ``batch`` (1), ``max_distances`` (K values, default 64), ``repeats`` (15), ``warmup`` (3),
    ``dtype`` ("float32"), ``threads`` (torch's default), ``backends`` (extra backends to
    time by name; default every available one except ``reference``), ``out`` (a directory
    for ``decode.md``/``decode.csv``, or a ``.md`` path; None = print only), ``quick`` (a
    smoke run: S = 512, 1024, 1 warm-up, 3 rounds).

    Returns:
        0 (the exit status).
    """
    from relpos import __version__, available_backends

    quick = bool(getattr(args, "quick", False))  # a small smoke run
    lengths = _ints(getattr(args, "lengths", None), (512, 1024) if quick else DEFAULT_LENGTHS,
                    "lengths")
    steps = _ints(getattr(args, "steps", None), DEFAULT_STEPS, "steps")
    Ks = _ints(getattr(args, "max_distances", None) or getattr(args, "max_distance", None),
               (64,), "max-distances")
    heads = _ints(getattr(args, "heads", None), (8,), "heads")[0]
    head_dim = _ints(getattr(args, "head_dim", None), (64,), "head-dim")[0]
    batch = _ints(getattr(args, "batch", None), (1,), "batch")[0]
    repeats = _ints(getattr(args, "repeats", None), (3,) if quick else (15,), "repeats")[0]
    warmup = getattr(args, "warmup", None)
    warmup = (1 if quick else 3) if warmup is None else int(warmup)
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    dtype_name = str(getattr(args, "dtype", None) or "float32")
    if dtype_name not in _DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype_name!r}")
    threads = getattr(args, "threads", None)
    if threads is not None:
        if int(threads) <= 0:
            raise ValueError(f"--threads must be positive, got {threads}")
        torch.set_num_threads(int(threads))
    requested = getattr(args, "backends", None)
    available = available_backends()
    if requested is None:
        extra = [b for b in available if b != "reference"]
    else:
        extra = [b for b in (requested.split(",") if isinstance(requested, str) else requested)
                 if b]
        unknown = [b for b in extra if b not in available]
        if unknown:
            raise ValueError(f"unknown backends {unknown}; available: {', '.join(available)}")
    paths = _output_paths(getattr(args, "out", None))

    results: list[DecodeResult] = []
    methods = ["sdpa", "relpos", *extra]
    header = f"{'K':>4} {'t':>3} {'S':>6} {'auto':>9} " + " ".join(
        f"{m + ' ms':>13}" for m in methods
    ) + " " + " ".join(f"{m + '/sdpa':>14}" for m in methods[1:])
    print(header, flush=True)
    for K in Ks:
        for t in steps:
            for S in lengths:
                if t > S:
                    continue
                r = measure_step(
                    S, t, batch=batch, heads=heads, head_dim=head_dim, max_distance=K,
                    dtype=_DTYPES[dtype_name], repeats=repeats, warmup=warmup, backends=extra,
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
        command = getattr(args, "command_line", None) or "relpos " + " ".join(sys.argv[1:])
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "hardware": hardware(),
            "torch": torch.__version__,
            "relpos": __version__,
            "python": platform.python_version(),
            "threads": str(torch.get_num_threads()),
            "dtype": dtype_name,
            "shape": f"B={batch}, H={heads}, D={head_dim}",
            "repeats": f"{repeats} measured rounds after {warmup} warm-up rounds (median)",
            "command": command,
        }
        md_path, csv_path = paths
        md_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(csv_path, _csv(results, methods))
        atomic_write_text(md_path, _markdown(results, methods, meta, csv_path.name))
        print(f"wrote {md_path} and {csv_path}")
    return 0


def _csv(results: list[DecodeResult], methods: list[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["K", "t", "S", "auto_backend", *(f"{m}_ms" for m in methods),
                *(f"{m}_over_sdpa" for m in methods[1:])])
    for r in results:
        w.writerow([r.K, r.t, r.S, r.backend, *(f"{r.ms[m]:.4f}" for m in methods),
                    *(f"{r.ratio(m):.3f}" for m in methods[1:])])
    return buf.getvalue()


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
        *(f"- **{k}**: `{v}`" if k == "command" else f"- **{k}**: {v}" for k, v in meta.items()),
        "",
        f"Raw numbers: [`{csv_name}`]({csv_name}).",
        "",
    ]
    head = ["K", "t", "S", "auto", *(f"{m} ms" for m in methods),
            *(f"{m}/sdpa" for m in methods[1:])]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---:" for _ in head) + "|")
    for r in results:
        cells = [str(r.K), str(r.t), str(r.S), r.backend,
                 *(f"{r.ms[m]:.3f}" for m in methods),
                 *(f"{r.ratio(m):.2f}" for m in methods[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - convenience entry point
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--steps", type=int, nargs="+")
    parser.add_argument("--max-distances", type=int, nargs="+")
    parser.add_argument("--heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--backends")
    parser.add_argument("--out")
    ns = parser.parse_args()
    ns.command_line = "python -m relpos.bench_decode " + " ".join(sys.argv[1:])
    raise SystemExit(run_decode(ns))
