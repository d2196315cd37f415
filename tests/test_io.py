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
