"""The native kernels' sources as the build sees them: every translation unit in ``csrc/`` is
compiled, and the build's key (the directory a build lives in) covers every header, so an edit
of any file the compiler reads builds anew instead of loading a stale library."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from relpos.ops.native import target


def test_every_translation_unit_is_compiled() -> None:
    units = {p.name for p in target._CSRC.glob("*.cpp")}
    assert {s.name for s in target.SOURCES} == units
    assert len(list(target._CSRC.glob("*.h"))) > 10


@pytest.mark.parametrize("name", ["vec.h", "backward.h", "attention.cpp"])
def test_an_edit_of_any_source_changes_the_build_key(name: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(target._CSRC, csrc)
    monkeypatch.setattr(target, "_CSRC", csrc)
    monkeypatch.setattr(target, "SOURCES", tuple(csrc / s.name for s in target.SOURCES))
    before = target.Target().key
    assert target.Target().key == before
    edited = csrc / name
    edited.write_text(edited.read_text() + "\n// an edit\n")
    assert target.Target().key != before
