"""``relpos.ops._custom_op``: the scaffolding of the three attention custom ops. The backward
ops' schemas are derived from the forward ops'; the ops themselves are checked with
``torch.library.opcheck`` in each backend's tests."""

from __future__ import annotations

import math

import pytest
import torch

import relpos.ops.flash_regions.op
import relpos.ops.native.op
import relpos.ops.triton.op  # noqa: F401  (registers the ops)
from relpos.ops._custom_op import empty_gradients, empty_outputs, is_empty

_OPTIONS = "SymInt left, SymInt right, bool is_causal, float scale, SymInt query_start"
_TABLES = "Tensor query, Tensor key, Tensor value, Tensor? rel_keys, Tensor? rel_values"
_GRADIENTS = "(Tensor, Tensor, Tensor, Tensor, Tensor)"
SCHEMAS = {
    "fused_attention": (
        f"({_TABLES}, Tensor? key_mask, *, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)",
        f"(Tensor grad_out, {_TABLES}, Tensor? key_mask, Tensor out, Tensor lse, "
        f"Tensor o_left, Tensor masses, *, {_OPTIONS}) -> {_GRADIENTS}",
    ),
    "native_attention": (
        f"({_TABLES}, Tensor? key_bias, Tensor? attn_bias, Tensor? seed, *, {_OPTIONS}, "
        "float dropout_p) -> (Tensor, Tensor)",
        f"(Tensor grad_out, {_TABLES}, Tensor? key_bias, Tensor? attn_bias, Tensor? seed, "
        f"Tensor out, Tensor lse, *, {_OPTIONS}, float dropout_p) -> {_GRADIENTS}",
    ),
    "native_attention_varlen": (
        f"({_TABLES}, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, "
        "Tensor? seed, *, SymInt left, SymInt right, bool is_causal, float scale, "
        "float dropout_p) -> (Tensor, Tensor)",
        f"(Tensor grad_out, {_TABLES}, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "Tensor? seqused_k, Tensor? seed, Tensor out, Tensor lse, *, SymInt left, "
        f"SymInt right, bool is_causal, float scale, float dropout_p) -> {_GRADIENTS}",
    ),
    "triton_attention_varlen": (
        f"({_TABLES}, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, *, "
        "SymInt left, SymInt right, bool is_causal, float scale) -> (Tensor, Tensor, Tensor)",
        f"(Tensor grad_out, {_TABLES}, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "Tensor? seqused_k, Tensor out, Tensor lse, Tensor pb, *, SymInt left, SymInt right, "
        f"bool is_causal, float scale) -> {_GRADIENTS}",
    ),
    "triton_attention": (
        f"({_TABLES}, Tensor? key_mask, *, {_OPTIONS}) -> (Tensor, Tensor, Tensor)",
        f"(Tensor grad_out, {_TABLES}, Tensor? key_mask, Tensor out, Tensor lse, Tensor pb, "
        f"*, {_OPTIONS}) -> {_GRADIENTS}",
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_ops_keep_their_schemas(name: str) -> None:
    forward, backward = SCHEMAS[name]
    assert str(getattr(torch.ops.relpos, name).default._schema) == f"relpos::{name}{forward}"
    assert (str(getattr(torch.ops.relpos, f"{name}_backward").default._schema)
            == f"relpos::{name}_backward{backward}")


def test_empty_calls() -> None:
    q = torch.randn(2, 3, 0, 4)
    k = torch.randn(2, 3, 5, 4)
    assert is_empty(q, k) and is_empty(k, q[:, :, :, :0]) and is_empty(k[:0], k)
    assert not is_empty(k, k)
    out, lse, extra = empty_outputs((q.new_empty(2, 3, 0, 4), q.new_empty(2, 3, 1),
                                     q.new_empty(2, 3, 1, 2)))
    assert out.shape == (2, 3, 0, 4)
    assert torch.equal(lse, torch.full((2, 3, 1), math.inf))
    assert torch.equal(extra, torch.zeros(2, 3, 1, 2))


def test_empty_gradients_are_contiguous_and_empty_for_absent_tables() -> None:
    q = torch.randn(1, 4, 2, 3).transpose(1, 2)  # (1, 2, 4, 3), not contiguous
    table = torch.randn(5, 3)
    dq, _, _, drk, drv = empty_gradients(q, q, q, table, None)
    assert dq.shape == q.shape and dq.is_contiguous()
    assert drk.shape == table.shape and drv.shape == (0,)


@pytest.mark.parametrize("op", ["fused_attention", "native_attention", "triton_attention"])
def test_an_empty_call_runs_no_kernel_and_gives_zero_gradients(op: str) -> None:
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 0, 4, dtype=torch.float64, requires_grad=True)
    table = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    extra: tuple[None, ...] = (None,) * (3 if op == "native_attention" else 1)
    options: dict[str, object] = dict(left=2, right=2, is_causal=False, scale=0.5, query_start=0)
    if op == "native_attention":
        options["dropout_p"] = 0.0
    outputs = getattr(torch.ops.relpos, op)(q, k, k, table, None, *extra, **options)
    assert torch.equal(outputs[0], torch.zeros(1, 2, 3, 4, dtype=torch.float64))
    assert torch.equal(outputs[1], torch.full((1, 2, 3), math.inf, dtype=outputs[1].dtype))
    outputs[0].sum().backward()
    assert q.grad is not None and torch.equal(q.grad, torch.zeros_like(q))
    assert table.grad is not None and torch.equal(table.grad, torch.zeros_like(table))


_FIRST_STEP = r"""
import sys
import torch
import relpos

implementation = sys.argv[1]
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(3))
tables = dict(rel_keys=torch.randn(9, 8, requires_grad=True),
              rel_values=torch.randn(9, 8, requires_grad=True))
with torch.no_grad():  # what a process does before its first training step: load, evaluate
    relpos.relative_attention(q, k, v, max_distance=4, implementation=implementation, **tables)
if implementation == "native":
    assert relpos.select_backend(q, k, v, max_distance=4, **tables) == "native"
out = relpos.relative_attention(q, k, v, max_distance=4, implementation=implementation, **tables)
out.sum().backward()
assert q.grad is not None and tables["rel_values"].grad is not None
compile_stack = sorted(m for m in sys.modules
                       if m.split(".")[0] == "sympy" or m.startswith(("torch._dynamo",
                                                                      "torch._inductor")))
print(len(compile_stack), compile_stack[:5])
"""


@pytest.mark.parametrize("implementation", ["native", "flash_regions", "bucketed", "reference"])
def test_first_differentiable_call_imports_no_compile_stack(implementation):
    """A process's first forward + backward runs the op eagerly, without importing
    torch._dynamo / torch._inductor / sympy (about 900 modules and 150 MiB that
    ``torch.library.custom_op``'s kernel wrapper imports on its first call)."""
    if implementation == "native":
        from relpos.ops.native import build
        if build.load() is None:
            pytest.skip("the native kernels are not available here")
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _FIRST_STEP, implementation],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "0", proc.stdout

