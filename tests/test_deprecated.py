"""Moved modules and names keep working from their old paths, with a DeprecationWarning that
names the new one (relpos._deprecated)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from relpos._deprecated import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_warns_and_serves_the_new_one(old: str) -> None:
    new = MOVED_MODULES[old]
    news = (new,) if isinstance(new, str) else new
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated; use {' or '.join(news)}$"):
        shim = importlib.import_module(old)
    for target in map(importlib.import_module, news):
        names = (getattr(target, "__all__", None)
                 or [n for n in vars(target) if not n.startswith("_")])
        assert names, f"{target.__name__} has no public names to compare"
        for name in names:
            assert getattr(shim, name) is getattr(target, name), name
    assert shim.__all__ == [n for t in map(importlib.import_module, news)
                            for n in getattr(t, "__all__", ())]
    with pytest.raises(AttributeError):
        shim.no_such_name  # noqa: B018


def test_the_old_paths_have_no_files_and_the_new_ones_exist() -> None:
    for old, new in MOVED_MODULES.items():
        for target in (new,) if isinstance(new, str) else new:
            assert importlib.util.find_spec(target) is not None, target
        spec = importlib.util.find_spec(old)
        assert spec is not None and spec.origin is None, f"{old} is a file again: {spec}"


def test_an_old_path_warns_at_the_importing_line() -> None:
    code = "import relpos.tasks\n"
    err = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code],
                         capture_output=True, text=True, check=True).stderr
    assert err.startswith("<string>:1: DeprecationWarning: relpos.tasks is deprecated"), err


def test_unmoved_names_are_not_served() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("relpos.no_such_module")


@pytest.mark.parametrize(("name", "new"), [
    ("accumulation_dtype", "relpos.ops._numerics"),
    ("exp_", "relpos.ops._numerics"),
    ("empty_gradients", "relpos.ops._custom_op"),
])
def test_names_moved_out_of_ops_call_warn(name: str, new: str) -> None:
    from relpos.ops import call

    with pytest.warns(DeprecationWarning, match=rf"relpos\.ops\.call\.{name} is deprecated"):
        value = getattr(call, name)
    assert value is getattr(importlib.import_module(new), name)


def test_the_layers_import_from_their_old_module() -> None:
    import relpos

    sys.modules.pop("relpos.modules.transformer", None)
    with pytest.warns(DeprecationWarning, match=r"relpos\.modules\.transformer is deprecated; "
                                                r"use relpos\.modules\.transformer_layers$"):
        from relpos.modules.transformer import (  # type: ignore[import-not-found]
            RelativeTransformerDecoderLayer,
            RelativeTransformerEncoderLayer,
        )
    assert RelativeTransformerEncoderLayer is relpos.RelativeTransformerEncoderLayer
    assert RelativeTransformerDecoderLayer is relpos.RelativeTransformerDecoderLayer


@pytest.mark.parametrize("module", ["relpos.varlen", "relpos.varlen.call"])
def test_the_packed_call_keeps_its_old_name(module: str) -> None:
    from relpos.varlen import PackedAttentionCall

    with pytest.warns(DeprecationWarning, match=rf"{module}\.VarlenCall is deprecated; use "
                                                r"relpos\.varlen(\.call)?\.PackedAttentionCall$"):
        old = importlib.import_module(module).VarlenCall
    assert old is PackedAttentionCall
