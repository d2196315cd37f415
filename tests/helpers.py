"""Shared test helpers: random problems and a float64 comparison of backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import relpos

F64 = torch.float64


@dataclass
class Problem:
    query: Tensor
    key: Tensor
    value: Tensor
    rel_keys: Tensor | None
    rel_values: Tensor | None
    max_distance: int

    def leaves(self) -> list[Tensor]:
        return [t for t in (self.query, self.key, self.value, self.rel_keys, self.rel_values)
                if t is not None]


def make_problem(
    B: int = 2,
    H: int = 3,
    L: int = 5,
    S: int | None = None,
    D: int = 4,
    Dv: int | None = None,
    K: int = 2,
    *,
    per_head: bool = False,
    keys_term: bool = True,
    values_term: bool = True,
    dtype: torch.dtype = F64,
    seed: int = 0,
) -> Problem:
    S = L if S is None else S
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype).requires_grad_(True)

    table_lead = (H,) if per_head else ()
    return Problem(
        query=rnd(B, H, L, D),
        key=rnd(B, H, S, D),
        value=rnd(B, H, S, Dv),
        rel_keys=rnd(*table_lead, 2 * K + 1, D) if keys_term else None,
        rel_values=rnd(*table_lead, 2 * K + 1, Dv) if values_term else None,
        max_distance=K,
    )


def run(problem: Problem, implementation: str | None, **kwargs: object) -> Tensor:
    return relpos.relative_attention(
        problem.query, problem.key, problem.value, max_distance=problem.max_distance,
        rel_keys=problem.rel_keys, rel_values=problem.rel_values,
        implementation=implementation, **kwargs,  # type: ignore[arg-type]
    )


def forward_backward(
    problem: Problem, implementation: str | None, seed: int = 1, **kwargs: object
) -> tuple[Tensor, list[Tensor]]:
    """Output and the gradients of every leaf for a random upstream gradient."""
    out = run(problem, implementation, **kwargs)
    g = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    grads = torch.autograd.grad(out, problem.leaves(), upstream, allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if gr is None else gr
                          for t, gr in zip(problem.leaves(), grads, strict=True)]


def assert_same_as_reference(
    problem: Problem, implementation: str, *, atol: float = 1e-10, **kwargs: object
) -> None:
    out_ref, grads_ref = forward_backward(problem, "reference", **kwargs)
    out, grads = forward_backward(problem, implementation, **kwargs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=0)
    names = ["query", "key", "value", "rel_keys", "rel_values"]
    present = [n for n, t in zip(names, (problem.query, problem.key, problem.value,
                                         problem.rel_keys, problem.rel_values), strict=True)
               if t is not None]
    for name, g, g_ref in zip(present, grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def manual_mha(mha: relpos.RelativeMultiheadAttention, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """The module's math written out: projections, heads, reference attention, output.

    ``x`` is ``(B, L, E)``; ``kwargs`` are :func:`relpos.relative_attention`'s (its mask
    meanings: True = may attend, ``key_mask`` True = real token)."""
    B, L, E = x.shape
    H, D = mha.num_heads, mha.head_dim

    def heads(t):
        return t.view(B, L, H, D).transpose(1, 2)

    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    out = relpos.relative_attention(
        heads(x @ wq.T + bq), heads(x @ wk.T + bk), heads(x @ wv.T + bv),
        max_distance=mha.max_distance, rel_keys=mha.rel_keys, rel_values=mha.rel_values,
        implementation="reference", **kwargs,
    )
    return mha.out_proj(out.transpose(1, 2).reshape(B, L, E))


def serving_backends(**call: object) -> list[str]:
    """The backends of :func:`relpos.available_backends` that serve ``call`` (the arguments of
    :func:`relpos.relative_attention` without ``implementation``); a backend that refuses it
    is left out for this call only."""
    names = []
    for name in relpos.available_backends():
        try:
            relpos.select_backend(**call, implementation=name)  # type: ignore[arg-type]
        except RuntimeError as err:
            assert "cannot serve this call" in str(err), err
            continue
        names.append(name)
    return names


def run_ranks(worker: str, world: int, *args: str, timeout_s: float = 240.0) -> str:
    """Run ``python WORKER RANK WORLD PORT *args`` as ``world`` processes (gloo ranks on
    127.0.0.1 and a free port, one torch thread each), the native kernels built here first so
    that the ranks only load them. Each rank is joined under ``timeout_s`` and killed after it
    (a test may fail, never hang); fails the test unless every rank exits 0. Returns their
    output."""
    import os
    import subprocess
    import sys

    import pytest

    from relpos.ops.native import build
    from relpos.training.data_parallel import free_port

    build.load(quiet=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, worker, str(r), str(world), str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout_s)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"a rank of {world} ran past {timeout_s} s (hung?)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(outputs)
    assert all(p.returncode == 0 for p in procs), report[-6000:]
    return report


#: The language-model settings the decoding tests run every check on (float64, vocabulary 23):
#: windows, each table alone, per-head tables, a window wider than every sequence, and the
#: absolute positions.
DECODING_CONFIGS: list[dict] = [
    dict(max_distance=0),
    dict(max_distance=1),
    dict(max_distance=4),
    dict(max_distance=(3, 1)),
    dict(max_distance=(0, 5)),
    dict(max_distance=4, relative_keys=False),
    dict(max_distance=4, relative_values=False),
    dict(max_distance=3, share_heads=False),
    dict(max_distance=40),  # wider than every sequence here: the band is the whole cache
    dict(positions="learned"),
    dict(positions="sinusoidal"),
]


def random_lm(**kw: object):
    """A float64 ``RelativeTransformerLM`` in eval mode (vocabulary 23, d_model 24, 3 heads, 2
    layers; ``kw`` as ``ModelConfig`` takes them) whose tables and biases are moved away from
    their zero init, so that they matter."""
    from relpos.models import ModelConfig, RelativeTransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, d_model=24, num_heads=3, num_layers=2, **kw)  # type: ignore[arg-type]
    model = RelativeTransformerLM(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model
