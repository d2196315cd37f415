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
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated; use {new}$"):
        shim = importlib.import_module(old)
    target = importlib.import_module(new)
    names = getattr(target, "__all__", None) or [n for n in vars(target) if not n.startswith("_")]
    assert names, f"{new} has no public names to compare"
    for name in names:
        assert getattr(shim, name) is getattr(target, name), name
    assert shim.__all__ == list(getattr(target, "__all__", ()))
    with pytest.raises(AttributeError):
        shim.no_such_name  # noqa: B018


def test_the_old_paths_have_no_files_and_the_new_ones_exist() -> None:
    for old, new in MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, new
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
