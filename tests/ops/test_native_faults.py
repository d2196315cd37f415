"""Faults in what a load of the native kernels reads, and pruning by last use
(relpos.ops.native: kernels_dir, verify, pruning).

A kernels directory that cannot be searched, a truncated library whose checksum was
recomputed, a checksum record that is a FIFO or a device: each is passed by with one warning
(the user cache serves), never a crash, a hang or an unbounded read. Every call that could
crash or hang runs in a child process under a hard timeout (tests/ops/native_faults.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ops.native_faults import (
    LINUX,
    ROOT,
    TIMEOUT,
    _baseline,
    _copy,
    _damage,
    _native_without_warnings,
    _rehash,
    _run,
    built,
    in_process_cache,
    prebuilt_dir,
    shipped,
)
from relpos.ops.native import build, kernels_dir, pruning, verify

# (fixtures: pytest finds them by these names here)
_FIXTURES = (built, in_process_cache, prebuilt_dir, shipped)

# Root passes every permission check (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): a child that
# must meet a real EACCES as root gives up those two capabilities first (capset on itself is
# always allowed); another user meets it as it is.
NO_DAC_OVERRIDE = textwrap.dedent("""
    import ctypes, os
    if os.geteuid() == 0:
        class _Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class _Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]
        _libc = ctypes.CDLL(None, use_errno=True)
        _header, _data = _Header(0x20080522, 0), (_Data * 2)()
        assert _libc.capget(ctypes.byref(_header), _data) == 0, ctypes.get_errno()
        _data[0].effective &= ~0b110  # CAP_DAC_OVERRIDE (1), CAP_DAC_READ_SEARCH (2)
        _data[0].permitted &= ~0b110
        assert _libc.capset(ctypes.byref(_header), _data) == 0, ctypes.get_errno()
""")

KERNELS = NO_DAC_OVERRIDE + "from relpos.cli import main\nraise SystemExit(main(['kernels']))\n"


def _env(shipped: Path, cache: Path) -> dict[str, str]:
    return {"RELPOS_KERNELS_DIR": str(shipped), "RELPOS_CACHE_DIR": str(cache)}


def _cache_serves(result: dict, cache: Path, built: Path) -> None:
    assert Path(result["library"]).parent == cache / "kernels" / built.name, result


# ------------------------------------------------------------------------------------------
# 1. A kernels directory that cannot be searched or read


@pytest.mark.skipif(not LINUX, reason="permissions and capabilities as Linux has them")
@pytest.mark.parametrize("closed", ["directory", "variant"])
def test_an_unsearchable_kernels_directory_is_passed_by_with_one_warning(
        shipped: Path, built: Path, tmp_path: Path, closed: str) -> None:
    # A tree made under umask 077, read by another user: searching it fails with EACCES,
    # which Path.is_file() does not swallow; every call crashed, and `relpos kernels` too.
    cache = tmp_path / "cache"
    _copy(built, cache)
    shut = shipped if closed == "directory" else _baseline(shipped).library.parent
    shut.chmod(0)
    try:
        _, result = _run(_env(shipped, cache), NO_DAC_OVERRIDE)
        cli = subprocess.run([sys.executable, "-c", KERNELS], capture_output=True, text=True,
                             env={**os.environ, **_env(shipped, cache)}, cwd=ROOT,
                             timeout=TIMEOUT)
    finally:
        shut.chmod(0o755)
    assert result["backend"] == "native" and len(result["warnings"]) == 1, result
    warning = result["warnings"][0]
    assert f"RELPOS_KERNELS_DIR={shipped} is not used" in warning, warning
    assert "Permission denied" in warning and "user cache" in warning, warning  # a real EACCES
    if closed == "directory":
        assert "it cannot be searched (Permission denied)" in warning, warning
    else:
        assert "skipped baseline: " in warning and "cannot be read" in warning, warning
    _cache_serves(result, cache, built)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "  baseline:       unreadable: " in cli.stdout, cli.stdout
    assert "nothing here serves this machine" in cli.stdout, cli.stdout


# ------------------------------------------------------------------------------------------
# 2. A damaged prebuilt library whose checksum matches is never loaded


@pytest.mark.parametrize("record", ["recomputed", "recomputed, size kept"])
def test_a_truncated_prebuilt_library_with_a_recomputed_checksum_is_never_loaded(
        shipped: Path, built: Path, tmp_path: Path, record: str) -> None:
    # A copy interrupted and hashed again (or a disk-full write): the sha256 matches, and
    # dlopen of the library killed the process with SIGBUS.
    library = _baseline(shipped).library
    size = library.stat().st_size
    _damage(library, "truncated")
    _rehash(library, size=size if "size" in record else None)
    cache = tmp_path / "cache"
    _copy(built, cache)
    _, result = _run(_env(shipped, cache))
    assert result["backend"] == "native" and len(result["warnings"]) == 1, result
    warning = result["warnings"][0]
    assert "skipped baseline: " in warning and "is damaged: " in warning, warning
    assert "truncated" in warning and "user cache" in warning, warning
    _cache_serves(result, cache, built)


def test_a_damaged_prebuilt_library_whose_record_has_no_size_is_tried_in_a_child_first(
        shipped: Path, built: Path, tmp_path: Path) -> None:
    # Overwritten inside (its headers and length intact), hashed again by hand: nothing but a
    # load tells; the trial load dies in its own process, this one warns and falls back.
    library = _baseline(shipped).library
    _damage(library, "overwritten")
    _rehash(library)
    cache = tmp_path / "cache"
    _copy(built, cache)
    _, result = _run(_env(shipped, cache))
    assert result["backend"] == "native" and len(result["warnings"]) == 1, result
    warning = result["warnings"][0]
    assert "skipped baseline: " in warning, warning
    assert "killed a test process" in warning or "does not load" in warning, warning
    _cache_serves(result, cache, built)
    assert not (cache / kernels_dir.LOADS).exists()  # vouched for nothing


def test_a_sound_prebuilt_library_whose_record_has_no_size_is_tried_once_and_serves(
        shipped: Path, tmp_path: Path) -> None:
    """A record as an older relpos wrote it (no size): the library is loaded in a child
    first; the user's cache remembers that it did (its path, size, mtime and sha256)."""
    entry = _baseline(shipped)
    _rehash(entry.library)
    cache = tmp_path / "cache"
    for _ in range(2):
        done, result = _run(_env(shipped, cache))
        assert _native_without_warnings(result), (result, done.stderr)
        assert Path(result["library"]) == entry.library, result
    (stamp,) = (cache / kernels_dir.LOADS).iterdir()
    lines = stamp.read_text().splitlines()
    assert lines == [os.path.realpath(entry.library.parent), _baseline(shipped).identity]
    assert lines[1].endswith(verify.check(entry.library).identity.rsplit("\t", 1)[1])


def test_a_checksum_record_that_is_a_fifo_does_not_block_the_call(
        shipped: Path, built: Path, tmp_path: Path) -> None:
    # Reading a FIFO named <lib>.sha256 waited for a writer that never comes.
    record = build._checksum_path(_baseline(shipped).library)
    record.unlink()
    os.mkfifo(record)
    cache = tmp_path / "cache"
    _copy(built, cache)
    _, result = _run(_env(shipped, cache))
    assert result["backend"] == "native" and len(result["warnings"]) == 1, result
    assert "sha256 is not a regular file" in result["warnings"][0], result
    _cache_serves(result, cache, built)


@pytest.mark.parametrize("kind", ["device", "directory", "large", "no sha256"])
def test_a_checksum_record_is_read_only_as_a_small_regular_file(
        built: Path, tmp_path: Path, kind: str) -> None:
    library = tmp_path / build.library_path(built).name
    library.write_bytes(build.library_path(built).read_bytes())
    record = build._checksum_path(library)
    if kind == "device":  # a link to /dev/zero read without end
        record.symlink_to("/dev/zero")
    elif kind == "directory":
        record.mkdir()
    elif kind == "large":
        record.write_text(verify.check(build.library_path(built)).identity[-64:] + "\n" * 5000)
    else:
        record.write_text("not a checksum\n")
    problem = verify.check(library).problem
    expected = {"device": "is not a regular file", "directory": "is not a regular file",
                "large": "is larger than 4096 bytes", "no sha256": "holds no sha256"}[kind]
    assert problem is not None and expected in problem, problem
    if record.is_dir():
        record.rmdir()
    verify.write_record(library)  # a sound record makes it sound
    assert verify.check(library) == verify.Check(None, True, verify.check(library).identity)


@pytest.mark.parametrize("cut", [1, 64, 4096, 1 << 16])
def test_a_library_cut_anywhere_is_damaged_even_with_its_checksum_recomputed(
        built: Path, tmp_path: Path, cut: int) -> None:
    library = tmp_path / build.library_path(built).name
    whole = build.library_path(built).read_bytes()
    library.write_bytes(whole[:len(whole) - cut])
    _rehash(library)
    problem = verify.check(library).problem
    assert problem is not None and "damaged" in problem and "truncated" in problem, problem


# ------------------------------------------------------------------------------------------
# 3. Pruning a kernels directory keeps what a process loaded recently


def _age(directory: Path, days: float) -> None:
    then = time.time() - days * 86400
    for path in (directory, *directory.rglob("*")):
        os.utime(path, (then, then), follow_symlinks=False)


def test_prune_with_days_keeps_a_prebuilt_variant_another_environment_loaded(
        shipped: Path, tmp_path: Path, in_process_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads never write to a kernels directory: a variant built 10 days ago and loaded a
    minute ago (by another environment: here the baseline variant, counted as another
    version's) stays under ``--prune 7``, by this user's load stamp and, for another user's
    load, by its library's access time; without a recent load it goes."""
    if pruning.last_use_unknown(shipped) is not None:
        pytest.skip("the file system records no access times")
    entry = _baseline(shipped)
    monkeypatch.setattr(pruning, "variants", lambda: ())  # every variant is another's
    _age(shipped, 10)
    _, result = _run(_env(shipped, in_process_cache))  # this user loads it
    assert Path(result["library"]) == entry.library, result

    def prune() -> pruning.Pruned:
        (found,) = build.prune(shipped, unused_days=7)
        return found

    # by this user's stamp alone (the library's access time set back)
    old = time.time() - 10 * 86400
    os.utime(entry.library, (old, old))
    found = prune()
    assert found.kept == "loaded 0 minutes ago" and entry.library.is_file(), found
    # another user's load: no stamp of this user's, the library's access time
    _run(_env(shipped, tmp_path / "another"))
    monkeypatch.setenv("RELPOS_CACHE_DIR", str(tmp_path / "pruner"))
    found = prune()
    assert found.kept == "loaded 0 minutes ago" and entry.library.is_file(), found
    # no load for 10 days: removed
    os.utime(entry.library, (old, old))
    found = prune()
    assert found.kept is None and not entry.library.parent.exists(), found


def test_prune_with_days_is_refused_where_last_loads_cannot_be_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    monkeypatch.setattr(pruning, "last_use_unknown",
                        lambda root: f"{root} is on a file system mounted noatime")
    into = tmp_path / "kernels"
    assert main(["kernels", "--build", "--into", str(into), "--prune", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("relpos: error: --prune 7: ") and "noatime" in err, err
    assert "without DAYS" in err and not into.exists(), err  # refused before any build
    with pytest.raises(ValueError, match="cannot prune by days of disuse"):
        build.prune(into, unused_days=7)
    assert build.prune(into) == []  # without DAYS: as asked
