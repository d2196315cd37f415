"""Atomic writes: the temporary files of writes that were killed are removed by the next
write in the directory, and nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from relpos import _io


def _dead_pid() -> int:
    """A pid no process has: above the largest Linux allows (2**22), and macOS's."""
    return 2**22 + 1


def test_the_temporary_file_is_named_after_the_target_and_the_writer(tmp_path, monkeypatch):
    seen = []

    def save(tmp: str) -> None:
        seen.append(os.path.basename(tmp))
        with open(tmp, "w") as handle:
            handle.write("{}")

    _io.atomic_save(tmp_path / "latest.json", save)
    assert _io._TEMPORARY.match(seen[0])
    assert seen[0].startswith(f".latest.json.{os.getpid()}.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json"]


@pytest.mark.skipif(os.name != "posix", reason="asks the OS whether the writer still runs")
def test_a_killed_write_leaves_nothing_after_the_next_one(tmp_path):
    # A write of latest.json killed between mkstemp and the rename (as SIGKILL would).
    script = (
        "import os, sys\n"
        "from relpos import _io\n"
        "def save(tmp):\n"
        "    open(tmp, 'w').write('{\"half')\n"
        "    os._exit(9)\n"
        f"_io.atomic_save({str(tmp_path / 'latest.json')!r}, save)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert subprocess.run([sys.executable, "-c", script], env=env, check=False).returncode == 9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".latest.json.") and left[0].endswith(".tmp")
    _io.atomic_write_text(tmp_path / "latest.json", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json"]


@pytest.mark.skipif(os.name != "posix", reason="asks the OS whether the writer still runs")
def test_only_stale_temporaries_of_the_helper_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    keep = [
        f".metrics.json.{alive}.abcd1234.tmp",  # a writer that still runs
        f".metrics.json.{os.getpid()}.abcd1234.tmp",  # this process (another thread)
        ".report.md.abcd1234.tmp",  # an earlier relpos's, for another target
        ".latest.json.abcd1234.tmp",  # an earlier relpos's, for this target, but recent
        "notes.tmp", ".hidden.tmp", f".x.{dead}.short.tmp",  # not the helper's names
        f"latest.json.{dead}.abcd1234.tmp",  # no leading dot: not the helper's
    ]
    remove = [f".latest.json.{dead}.abcd1234.tmp", f".metrics.json.{dead}.z_9y8x7w.tmp",
              ".latest.json.old00001.tmp"]
    for name in keep + remove:
        (tmp_path / name).write_text("partial")
    old = time.time() - 2 * _io.STALE_AGE_S
    os.utime(tmp_path / ".latest.json.old00001.tmp", (old, old))
    _io.atomic_write_text(tmp_path / "latest.json", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, "latest.json"])


def test_a_directory_named_like_a_temporary_is_kept(tmp_path):
    (tmp_path / f".latest.json.{_dead_pid()}.abcd1234.tmp").mkdir()
    _io.atomic_write_text(tmp_path / "latest.json", "{}\n")
    assert len(list(tmp_path.iterdir())) == 2


# --- atomic_directory --------------------------------------------------------------------------


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_directory_is_written_under_a_temporary_name_then_renamed(tmp_path):
    target = tmp_path / "lm"
    with _io.atomic_directory(target) as tmp:
        assert _io._TEMPORARY.match(tmp.name) and tmp.parent == tmp_path
        assert tmp.name.startswith(f".lm.{os.getpid()}.") and not target.exists()
        (tmp / "model.bin").write_bytes(b"weights")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("a")
    assert _names(tmp_path) == ["lm"]
    assert _names(target) == ["model.bin", "sub"]
    assert (target / "sub" / "a.txt").read_text() == "a"


def test_a_failed_directory_write_leaves_the_old_one_and_no_temporary(tmp_path):
    target = tmp_path / "lm"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(OSError, match="disk full"), _io.atomic_directory(target,
                                                                          replace=True) as tmp:
        (tmp / "model.bin").write_bytes(b"half")
        raise OSError("disk full")
    assert _names(tmp_path) == ["lm"] and _names(target) == ["old.txt"]


def test_replace_swaps_an_existing_directory(tmp_path):
    target = tmp_path / "lm"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with _io.atomic_directory(target, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _names(tmp_path) == ["lm"] and _names(target) == ["new.txt"]


def test_an_existing_path_is_refused_without_replace(tmp_path):
    target = tmp_path / "lm"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match="replace=True"), _io.atomic_directory(target):
        pytest.fail("the block must not run")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"), _io.atomic_directory(
        tmp_path / "file", replace=True
    ):
        pytest.fail("the block must not run")
    with pytest.raises(FileNotFoundError, match="does not exist"), _io.atomic_directory(
        tmp_path / "no" / "lm"
    ):
        pytest.fail("the block must not run")
    # A directory that appears while the new one is written is not replaced either.
    late = tmp_path / "late"
    with pytest.raises(FileExistsError, match="replace=True"), _io.atomic_directory(late) as tmp:
        (tmp / "new.txt").write_text("new")
        late.mkdir()
    assert _names(tmp_path) == ["file", "late", "lm"]
    assert _names(target) == ["old.txt"] and _names(late) == []


def test_a_failed_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "lm"
    target.mkdir()
    (target / "old.txt").write_text("old")
    real = os.replace
    calls = []

    def replace(src, dst):
        calls.append((os.path.basename(src), os.path.basename(dst)))
        if len(calls) == 2:  # the new directory into place
            raise OSError("rename failed")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"), _io.atomic_directory(
        target, replace=True
    ) as tmp:
        (tmp / "new.txt").write_text("new")
    monkeypatch.undo()
    assert calls[0][0] == "lm" and calls[1][1] == "lm" and len(calls) == 3
    assert _names(tmp_path) == ["lm"] and _names(target) == ["old.txt"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_directory_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with _io.atomic_directory(tmp_path / "lm") as tmp:
            (tmp / "a.txt").write_text("a")
    finally:
        os.umask(old)
    assert (tmp_path / "lm").stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.mark.skipif(os.name != "posix", reason="asks the OS whether the writer still runs")
def test_stale_temporary_directories_of_dead_writers_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    remove = [f".lm.{dead}.abcd1234.tmp"]
    keep = [
        f".lm.{alive}.abcd1234.tmp",  # a writer that still runs
        f".lm.{os.getpid()}.abcd1234.tmp",  # this process
        f".other.{dead}.abcd1234.tmp",  # another target's
    ]
    for name in remove + keep:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.bin").write_bytes(b"half")
    (tmp_path / f".lm.{dead}.file0000.tmp").write_text("x")  # a file: atomic_save's to clean
    with _io.atomic_directory(tmp_path / "lm") as tmp:
        (tmp / "a.txt").write_text("a")
    assert _names(tmp_path) == sorted([*keep, f".lm.{dead}.file0000.tmp", "lm"])


@pytest.mark.skipif(os.name != "posix", reason="asks the OS whether the writer still runs")
def test_a_killed_directory_write_leaves_nothing_after_the_next_one(tmp_path):
    script = (
        "import os\n"
        "from relpos import _io\n"
        f"with _io.atomic_directory({str(tmp_path / 'lm')!r}) as tmp:\n"
        "    (tmp / 'model.bin').write_bytes(b'half')\n"
        "    os._exit(9)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert subprocess.run([sys.executable, "-c", script], env=env, check=False).returncode == 9
    left = _names(tmp_path)
    assert len(left) == 1 and _io._TEMPORARY.match(left[0]) and left[0].startswith(".lm.")
    with _io.atomic_directory(tmp_path / "lm", replace=True) as tmp:
        (tmp / "model.bin").write_bytes(b"whole")
    assert _names(tmp_path) == ["lm"]
