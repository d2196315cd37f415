"""What the attention custom ops share: the empty call, the backward op and the autograd formula.

Three backends run as custom ops (flash_regions as ``relpos::fused_attention``, the name it had
before the backend was renamed; ``relpos::native_attention``, ``relpos::triton_attention``; packed
variable-length batches: ``relpos::native_attention_varlen``), so that ``torch.compile`` and
``torch.export`` trace them. Each op takes ``query, key, value, rel_keys, rel_values`` and then
inputs of its own (masks, a dropout seed, cumulative sequence lengths: none of them gets a
gradient), keyword options (``left``, ``right``, ``is_causal``, ...), and returns ``out``, the
logsumexp, then whatever else its backward needs. :func:`define_op` registers an op (in place of
``torch.library.custom_op``, whose eager path imports the compile stack: see its docstring). A
backend's ``op.py`` keeps what is its own: the forward, the fake (its outputs' shapes) and the
backward's computation; :func:`register_attention_autograd` builds the rest from them:

- the backward op ``<name>_backward``: ``grad_out``, the forward's inputs and outputs and the
  same options in, the five gradients out (an empty tensor for an absent table), with a fake;
- the autograd formula that saves the inputs and outputs and calls the backward op.

A call with nothing to attend (L, S or B·H is 0; for the varlen op Tq, Tk or H) runs no kernel
in either direction: the forward returns :func:`empty_outputs`, the backward zeros.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from relpos.ops.call import AttentionCall

__all__ = [
    "AttentionOp", "Gradients", "define_key_mask_op", "define_op", "empty_gradients",
    "empty_outputs", "is_empty", "register_attention_autograd", "run_key_mask_op",
]

Gradients = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]
"""``dq, dk, dv, drel_keys, drel_values`` as a backward computes them (None: no table)."""

_TABLES = 5  # query, key, value, rel_keys, rel_values: the inputs every op starts with
_Outputs = TypeVar("_Outputs", bound=tuple[Tensor, ...])


#: The ``relpos`` namespace of ops; kept alive for the process (its ops die with it).
_LIBRARY = torch.library.Library("relpos", "FRAGMENT")


class AttentionOp:
    """An op registered by :func:`define_op`: call it like the function it was defined from.

    Attributes:
        qualname: ``"relpos::<name>"``.
        default: the op's overload, ``torch.ops.relpos.<name>.default``.
    """

    def __init__(self, qualname: str, fn: Callable[..., Any]) -> None:
        self.qualname = qualname
        namespace, name = qualname.split("::")
        self.default: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        self.__doc__ = fn.__doc__
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Give the op its fake (the outputs' shapes, for ``torch.compile`` and
        ``torch.export``); returns ``fake``."""
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def define_op(qualname: str, fn: Callable[..., Any] | None = None, *,
              schema: str | None = None) -> Any:
    """Register ``fn`` as the op ``qualname`` (``"relpos::<name>"``), its only kernel, for every
    device (``CompositeExplicitAutograd``); usable as a decorator. The schema is inferred from
    ``fn``'s annotations unless given (``(<arguments>) -> <returns>``); no argument is mutated.

    This is ``torch.library.custom_op`` without its eager cost: custom_op wraps every kernel in
    ``torch._disable_dynamo``, which imports the whole compile stack (``torch._dynamo``,
    ``torch._inductor``, sympy: about 900 modules, 150 MiB and 1.8 s) on a process's first call
    that reaches the kernel, i.e. its first training step. Registered here with the library's
    own ``define`` / ``impl``, the op dispatches straight to ``fn``; ``torch.compile`` and
    ``torch.export`` still trace it as one op through its fake, and ``torch.library.opcheck``
    checks it as before (tests/ops/test_custom_op.py asserts the eager path imports none of
    that).
    """
    if fn is None:
        return lambda f: define_op(qualname, f, schema=schema)
    namespace, name = qualname.split("::")
    assert namespace == "relpos", qualname
    if schema is None:
        schema = torch.library.infer_schema(fn, mutates_args=())
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
    return AttentionOp(qualname, fn)


def is_empty(query: Tensor, key: Tensor) -> bool:
    """Whether the call has no (query, key) pair: ``L == 0``, ``S == 0`` or ``B·H == 0``."""
    B, H, L, _ = query.shape
    return L == 0 or key.shape[2] == 0 or B * H == 0


def empty_outputs(outputs: _Outputs) -> _Outputs:
    """What a forward op returns for an empty call (:func:`is_empty`), shaped like ``outputs``
    (its fake's): zeros, and ``+inf`` for the logsumexp (the second output) so that
    ``exp(score - lse)`` is 0, never NaN."""
    return cast(_Outputs, tuple(
        t.new_full(t.shape, math.inf) if i == 1 else t.new_zeros(t.shape)
        for i, t in enumerate(outputs)
    ))


def _key_mask_arguments(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, *, left: int, right: int,
    is_causal: bool, scale: float, query_start: int,
) -> Tensor:
    """The arguments of an op that takes a call's ``key_mask`` as it is (its schema is read
    from this signature; never called)."""
    raise NotImplementedError


def define_key_mask_op(qualname: str, forward: Callable[..., Any], fake: Callable[..., Any], *,
                       outputs: int, doc: str) -> AttentionOp:
    """Define the op ``qualname`` of a backend that takes a call's ``key_mask`` as it is
    (flash_regions, triton; :func:`run_key_mask_op` runs it), with ``outputs`` tensors out, and
    register its ``fake``. A call with nothing to attend returns :func:`empty_outputs` shaped
    by the fake; any other runs ``forward`` on the contiguous query, key and value (the op
    reads its inputs in any layout), the tables, the key mask and the options.

    Returns:
        The op, documented by ``doc``.
    """
    arguments = torch.library.infer_schema(_key_mask_arguments, mutates_args=())
    schema = arguments.rsplit(" -> ", 1)[0] + f" -> ({', '.join(['Tensor'] * outputs)})"

    def op(query: Tensor, key: Tensor, value: Tensor, *masks_and_tables: Tensor | None,
           **options: Any) -> Any:
        if is_empty(query, key):
            return empty_outputs(fake(query, key, value, *masks_and_tables, **options))
        return forward(query.contiguous(), key.contiguous(), value.contiguous(),
                       *masks_and_tables, **options)

    op.__doc__ = doc
    defined: AttentionOp = define_op(qualname, op, schema=schema)
    defined.register_fake(fake)
    return defined


def run_key_mask_op(op: Callable[..., tuple[Tensor, ...]], call: AttentionCall) -> Tensor:
    """``out`` of ``op`` for ``call``, an op that takes the call's ``key_mask`` as it is
    (flash_regions, triton): ``op(query, key, value, rel_keys, rel_values, key_mask, *, left, right,
    is_causal, scale, query_start)``."""
    return op(
        call.query, call.key, call.value, call.rel_keys, call.rel_values, call.key_mask,
        left=call.left, right=call.right, is_causal=call.is_causal, scale=call.scale,
        query_start=call.query_start,
    )[0]


def empty_gradients(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Fresh contiguous gradients shaped like the inputs (``torch.empty(0)`` for an absent
    table), whatever the inputs' strides: what the backward ops return, so their fake."""
    return (
        query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
        query.new_empty(0) if rel_keys is None else rel_keys.new_empty(rel_keys.shape),
        query.new_empty(0) if rel_values is None else rel_values.new_empty(rel_values.shape),
    )


def _zero_gradients(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return cast(tuple[Tensor, Tensor, Tensor, Tensor, Tensor], tuple(
        t.zero_() for t in empty_gradients(query, key, value, rel_keys, rel_values)))


def _table_gradient(grad: Tensor | None, table: Tensor | None, query: Tensor) -> Tensor:
    """A table's gradient as the backward op returns it: an empty tensor for an absent table."""
    if table is None:
        return query.new_empty(0)
    assert grad is not None, "a backward gave no gradient for a table it was given"
    return grad


def _backward_schema(forward: torch._ops.OpOverload, saved_outputs: Sequence[str]) -> str:
    """``(Tensor grad_out, <the forward's inputs>, Tensor <output>..., *, <its options>)`` to
    five tensors, from the forward's schema ``name(<inputs>, *, <options>) -> (...)``."""
    text = str(forward._schema)
    inputs, options = text[text.index("(") + 1 : text.index(") -> ")].split(", *, ")
    saved = ", ".join(f"Tensor {name}" for name in saved_outputs)
    return f"(Tensor grad_out, {inputs}, {saved}, *, {options}) -> ({', '.join(['Tensor'] * 5)})"


def register_attention_autograd(
    qualname: str, backward: Callable[..., Gradients], *, saved_outputs: Sequence[str],
    empty: Callable[[Tensor, Tensor], bool] = is_empty,
) -> AttentionOp:
    """Give the attention op ``qualname`` its backward op and its autograd formula.

    Args:
        qualname: the forward op, ``"relpos::<name>"``, registered already: ``query, key,
            value, rel_keys, rel_values`` and its own inputs, keyword-only options; returns
            ``out`` first.
        backward: ``backward(grad_out, *inputs, *outputs, **options)`` -> :data:`Gradients`,
            called for non-empty calls only.
        saved_outputs: names for the forward's outputs, in order (all of them are saved; the
            backward op takes them under these names).
        empty: ``empty(query, key)``, whether a call has nothing to attend (its backward then
            gives zeros without calling ``backward``); default :func:`is_empty`, for the
            ``(B, H, L, D)`` layout.

    Returns:
        The backward op ``relpos::<name>_backward``.
    """
    namespace, name = qualname.split("::")
    forward = getattr(getattr(torch.ops, namespace), name).default
    assert len(forward._schema.returns) == len(saved_outputs), (qualname, saved_outputs)
    n_inputs = sum(not a.kwarg_only for a in forward._schema.arguments)

    def run(grad_out: Tensor, *saved: Tensor | None, **options: Any) -> tuple[Tensor, ...]:
        query, key, value, rel_keys, rel_values = saved[:_TABLES]
        assert query is not None and key is not None and value is not None
        if empty(query, key):
            return _zero_gradients(query, key, value, rel_keys, rel_values)
        dq, dk, dv, drk, drv = backward(grad_out, *saved, **options)
        return (dq, dk, dv, _table_gradient(drk, rel_keys, query),
                _table_gradient(drv, rel_values, query))

    backward_op = define_op(f"{qualname}_backward", run,
                            schema=_backward_schema(forward, saved_outputs))

    @backward_op.register_fake
    def _(grad_out: Tensor, *saved: Any, **options: Any) -> tuple[Tensor, ...]:
        return empty_gradients(*saved[:_TABLES])

    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any],
        output: tuple[Tensor, ...],
    ) -> None:
        ctx.save_for_backward(*inputs, *output)
        ctx.set_materialize_grads(False)  # only ``out`` is public
        ctx.options = dict(keyword_only_inputs)

    def differentiate(ctx: Any, grad_out: Tensor | None, *_unused: Any) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(saved[n_inputs])  # ``out``
        dq, dk, dv, drk, drv = backward_op(grad_out, *saved, **ctx.options)
        rel_keys, rel_values = saved[3], saved[4]
        return (dq, dk, dv, None if rel_keys is None else drk,
                None if rel_values is None else drv, *[None] * (n_inputs - _TABLES))

    torch.library.register_autograd(qualname, differentiate, setup_context=setup_context,
                                    lib=_LIBRARY)
    return backward_op
