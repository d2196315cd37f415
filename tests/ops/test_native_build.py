"""The native kernels' build under faults: killed builds, damaged libraries, read-only caches,
no compiler, and prebuilt kernels in a read-only directory (relpos.ops.native.build).

What the tests share (the suite's build and baseline variant, the stand-in ``g++``, a call in
a child process under a hard timeout, whose numbers are compared with the reference backend
in float64) is in tests/ops/native_faults.py; tests/ops/test_native_faults.py has the faults
in what a load reads (records, permissions, switches) and pruning by last use.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.native_faults import (
    BUILD_INTO,
    CALL,
    LINUX,
    PREBUILT,
    ROOT,
    STALE,
    TIMEOUT,
    _baseline,
    _copy,
    _damage,
    _make_read_only,
    _native_without_warnings,
    _rehash,
    _remove,
    _run,
    _snapshot,
    _stale_build,
    built,
    fake_gxx,
    in_process_cache,
    library,
    prebuilt_dir,
    shipped,
)
from relpos.ops.native import build, compiling, kernels_dir

# (fixtures: pytest finds them by these names here)
_FIXTURES = (built, fake_gxx, in_process_cache, library, prebuilt_dir, shipped)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# ------------------------------------------------------------------------------------------
# 1. A killed build: no hang, no compiler left running


def test_what_a_build_killed_by_sigterm_leaves_does_not_block_the_next_call(
        tmp_path: Path, built: Path, fake_gxx: dict[str, str]) -> None:
    # `kill -TERM -- -PID` of a first build: ninja stopped its compiles and Python died
    # holding torch's baton, a file torch creates with O_CREAT | O_EXCL and every later
    # cpp_extension.load waits on until it is gone.
    directory = tmp_path / "cache" / "kernels" / built.name
    directory.mkdir(parents=True)
    shutil.copy2(built / "build.ninja", directory)
    (directory / "build.lock").touch()
    os.close(os.open(directory / "lock", os.O_CREAT | os.O_EXCL))
    done, result = _run({**fake_gxx, "RELPOS_CACHE_DIR": str(tmp_path / "cache")})
    assert _native_without_warnings(result), (result, done.stderr)
    assert "compiling the native CPU kernels" in done.stderr
    assert not (directory / "lock").exists()


@pytest.mark.skipif(not LINUX, reason="the build dies with its parent on Linux (PDEATHSIG)")
def test_a_build_killed_with_sigkill_takes_its_compiler_along_and_the_next_call_works(
        tmp_path: Path, built: Path, fake_gxx: dict[str, str]) -> None:
    cache = tmp_path / "cache"
    pids = tmp_path / "compiler.pids"
    slow = {**os.environ, **fake_gxx, "RELPOS_CACHE_DIR": str(cache),
            "FAKE_CXX_PIDS": str(pids), "FAKE_CXX_SLEEP": "120"}
    first = subprocess.Popen([sys.executable, "-c", CALL], env=slow, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    compiler: int | None = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (pids.exists() and pids.read_text().strip()):
            assert first.poll() is None, "the first call ended before its compile began"
            assert time.monotonic() < deadline, "the compile never began"
            time.sleep(0.05)
        compiler = int(pids.read_text().split()[0])
        os.kill(first.pid, signal.SIGKILL)  # the process alone, as `kill -9 PID` does
        first.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(compiler):  # ninja put it in a process group of its own
            assert time.monotonic() < deadline, "the compiler runs on as an orphan"
            time.sleep(0.05)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=10)
        if compiler is not None and _alive(compiler):
            os.killpg(os.getpgid(compiler), signal.SIGKILL)
    assert (cache / "kernels" / built.name / "lock").exists()  # torch's baton, left behind
    done, result = _run({**fake_gxx, "RELPOS_CACHE_DIR": str(cache)})
    assert _native_without_warnings(result), (result, done.stderr)
    assert "compiling the native CPU kernels" in done.stderr


# ------------------------------------------------------------------------------------------
# 2. A damaged library is never loaded


@pytest.mark.parametrize("record", ["as built", "recomputed", "recomputed, size kept"])
def test_a_damaged_library_is_rebuilt_never_loaded(
        tmp_path: Path, built: Path, fake_gxx: dict[str, str], record: str) -> None:
    # ninja's state is copied too: to ninja the truncated library is up to date. A checksum
    # recomputed after the damage matches: the size the build recorded, or the ELF headers
    # lying beyond the end of the file, still say it is truncated (else: SIGBUS).
    directory = _copy(built, tmp_path / "cache")
    library = build.library_path(directory)
    size = library.stat().st_size
    _damage(library, "truncated")
    if record != "as built":
        _rehash(library, size=size if "size" in record else None)
    done, result = _run({**fake_gxx, "RELPOS_CACHE_DIR": str(tmp_path / "cache")})
    assert _native_without_warnings(result), (result, done.stderr)
    # 5. a rebuild is announced as a first build is, with the reason
    assert "compiling the native CPU kernels" in done.stderr and "damaged" in done.stderr
    assert build._problem(build.library_path(directory)) is None  # rebuilt and recorded


def test_a_rebuild_is_announced_like_a_first_build(
        in_process_cache: Path, built: Path, library: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A library without its checksum (a link killed midway) is rebuilt, and that is said.
    directory = in_process_cache / "kernels" / built.name
    directory.mkdir(parents=True)
    shutil.copy2(library, build.library_path(directory))
    compiled: list[Path] = []

    def compile_(into: Path, target: build.Target) -> str:
        compiled.append(into)
        shutil.copy2(library, build.library_path(into))
        return "a faked build\n"

    monkeypatch.setattr(compiling, "_compile", compile_)
    assert build.load() is not None
    err = capsys.readouterr().err
    assert compiled == [directory]
    assert "compiling the native CPU kernels" in err and "no recorded checksum" in err
    assert "native kernels built in" in err and "other build" not in err, err
    assert build._problem(build.library_path(directory)) is None


def test_a_build_beside_older_ones_says_how_to_remove_them(
        in_process_cache: Path, library: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The first build after an upgrade names what the last release's builds take up."""
    _stale_build(in_process_cache / "kernels", STALE[0], 1_500_000)

    def compile_(into: Path, target: build.Target) -> str:
        shutil.copy2(library, build.library_path(into))
        return "a faked build\n"

    monkeypatch.setattr(compiling, "_compile", compile_)
    assert build.load() is not None
    err = capsys.readouterr().err
    assert ("; the cache holds 1 other build (1.5 MB; `relpos kernels --prune` removes them)"
            in err), err


def test_sources_newer_than_the_build_but_the_same_content_rebuild_nothing(
        tmp_path: Path, built: Path, fake_gxx: dict[str, str]) -> None:
    # A fresh checkout or a `touch` gives the sources new timestamps: the build is keyed on
    # their content (and the flags), so the build that exists serves, untouched.
    directory = _copy(built, tmp_path / "cache")
    library = build.library_path(directory)
    before = library.stat().st_mtime_ns
    stamps = {src: src.stat() for src in build.SOURCES}
    try:
        for src in build.SOURCES:
            os.utime(src, ns=(stamps[src].st_atime_ns, before + 60 * 10**9))
        done, result = _run({**fake_gxx, "RELPOS_CACHE_DIR": str(tmp_path / "cache")})
    finally:
        for src, st in stamps.items():
            os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _native_without_warnings(result), (result, done.stderr)
    assert "compiling" not in done.stderr, done.stderr
    assert library.stat().st_mtime_ns == before
    assert build._problem(library) is None


def test_relpos_kernels_reports_a_damaged_library(
        in_process_cache: Path, built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    _damage(build.library_path(_copy(built, in_process_cache)), "overwritten")
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "native kernels: damaged" in out and "not loaded" in out, out


# ------------------------------------------------------------------------------------------
# 3. A read-only cache with a complete build is used as it is


@pytest.fixture
def read_only_cache(built: Path) -> Iterator[Path]:
    """A cache holding what a shipped image holds (the library, its checksum, the lock file),
    in a directory any user can read (as root, tests run the child as ``nobody``, whom
    ``chmod a-w`` stops); made read-only by the test."""
    root = Path(tempfile.mkdtemp(prefix="relpos-read-only-"))
    try:
        root.chmod(0o755)
        directory = root / "kernels" / built.name
        directory.mkdir(parents=True)
        library = build.library_path(built)
        for path in (library, build._checksum_path(library), built / "build.lock"):
            shutil.copy2(path, directory)
        yield root
    finally:
        _remove(root)


# What a read-only directory does to a process that chmod does not stop (root): every call
# that would write under RELPOS_CACHE_DIR (or RELPOS_KERNELS_DIR) fails with EACCES (the
# snapshots of the tests check that nothing else writes).
READ_ONLY = textwrap.dedent("""
    import builtins, errno, io, os
    _roots = [os.path.realpath(os.environ[name]) + os.sep
              for name in ("RELPOS_CACHE_DIR", "RELPOS_KERNELS_DIR") if os.environ.get(name)]
    def _inside(path):
        return (isinstance(path, (str, bytes, os.PathLike))
                and any(os.path.realpath(os.fsdecode(path)).startswith(r) for r in _roots))
    def _refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
    def _guard(name, writes=lambda *args, **kwargs: True):
        real = getattr(os, name)
        def guarded(path, *args, **kwargs):
            if _inside(path) and writes(*args, **kwargs):
                _refuse(path)
            return real(path, *args, **kwargs)
        setattr(os, name, guarded)
    _guard("open", lambda flags, *args, **kwargs: flags & (
        os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    for _name in ("mkdir", "unlink", "remove", "rmdir", "replace", "rename", "chmod"):
        _guard(_name)
    _open = io.open
    def _guarded_open(file, mode="r", *args, **kwargs):
        if _inside(file) and any(c in mode for c in "wax+"):
            _refuse(file)
        return _open(file, mode, *args, **kwargs)
    builtins.open = io.open = _guarded_open
""")


@functools.cache
def _nobody_can_run_python() -> bool:
    try:
        return subprocess.run([sys.executable, "-c", "import torch, relpos"], user="nobody",
                              cwd=ROOT, capture_output=True, timeout=TIMEOUT).returncode == 0
    except (OSError, subprocess.SubprocessError, KeyError):  # no such user, cannot exec
        return False


def _read_only_child() -> tuple[str, dict[str, object]]:
    """The prelude and subprocess.run arguments of a child that a read-only cache stops: this
    user (not root: chmod a-w stops it), else ``nobody`` where it can run this Python, else
    root with READ_ONLY."""
    if os.geteuid() != 0:
        return "", {}
    if _nobody_can_run_python():
        return "", {"user": "nobody"}
    return READ_ONLY, {}


def test_a_read_only_cache_with_a_verified_build_is_used_without_writing(
        read_only_cache: Path) -> None:
    _make_read_only(read_only_cache)
    before = _snapshot(read_only_cache)
    prelude, kwargs = _read_only_child()
    done, result = _run({"RELPOS_CACHE_DIR": str(read_only_cache)}, prelude, **kwargs)
    assert _native_without_warnings(result), (result, done.stderr)
    assert "compiling" not in done.stderr
    assert _snapshot(read_only_cache) == before


def test_a_read_only_cache_with_a_damaged_build_warns_once_and_falls_back(
        read_only_cache: Path, built: Path) -> None:
    _damage(build.library_path(read_only_cache / "kernels" / built.name), "overwritten")
    _make_read_only(read_only_cache)
    before = _snapshot(read_only_cache)
    prelude, kwargs = _read_only_child()
    _, result = _run({"RELPOS_CACHE_DIR": str(read_only_cache)}, prelude, **kwargs)
    assert result["backend"] != "native" and len(result["warnings"]) == 1, result
    assert "cannot be written" in result["warnings"][0] and "damaged" in result["warnings"][0]
    assert _snapshot(read_only_cache) == before


def test_a_lock_that_cannot_be_opened_does_not_stop_a_verified_build(
        in_process_cache: Path, built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same in this process, for any user: opening build.lock fails as it does for an
    # unprivileged user on a read-only copy.
    directory = _copy(built, in_process_cache)
    before = _snapshot(in_process_cache)

    def refuse(self: object) -> None:
        raise PermissionError(13, "Permission denied", str(directory / "build.lock"))

    monkeypatch.setattr(build._FileLock, "acquire", refuse)
    module = build.load()
    assert module is not None and module.__spec__ is not None
    assert Path(str(module.__spec__.origin)).parent == directory
    assert _snapshot(in_process_cache) == before


# ------------------------------------------------------------------------------------------
# 4. A build that cannot run says why first


def test_without_a_compiler_the_warning_says_the_cause_first(tmp_path: Path) -> None:
    done, result = _run({"CXX": "/nonexistent", "RELPOS_CACHE_DIR": str(tmp_path / "cache")})
    assert result["backend"] != "native" and len(result["warnings"]) == 1, result
    first_line = result["warnings"][0].splitlines()[0]
    assert "could not be built" in first_line, first_line
    assert "C++ compiler was not found: CXX names '/nonexistent'" in first_line, first_line
    assert "compiling" not in done.stderr and "!! WARNING" not in done.stderr


def test_the_cause_of_a_failed_build_is_its_first_error() -> None:
    long_command = "c++ -MMD -MF relpos_native.o.d -Wno-error " + "-isystem /x " * 100
    cases = {
        # torch's message with a missing compiler, as the builder prints it
        f"RuntimeError: Error building extension 'relpos_native_0': [1/2] {long_command}\n"
        "/bin/sh: 1: /nonexistent: not found\nninja: build stopped: subcommand failed.\n":
            "/bin/sh: 1: /nonexistent: not found",
        # a compile error: the command after FAILED: names -Wno-error, then context lines
        "W1203 torch/utils/cpp_extension.py: Error checking compiler version for c++\n"
        "RuntimeError: Error building extension 'relpos_native_0': [1/2] c++ x.cpp\n"
        f"FAILED: relpos_native.o \n{long_command}\n"
        "/src/relpos_native.cpp: In function 'void f()':\n"
        "/src/relpos_native.cpp:10:5: error: 'g' was not declared in this scope\n"
        "   10 |     g();\n      |     ^\n"
        "/src/relpos_native.cpp:11:5: error: 'h' was not declared in this scope\n"
        "ninja: build stopped: subcommand failed.\n":
            "/src/relpos_native.cpp:10:5: error: 'g' was not declared in this scope",
        "RuntimeError: Ninja is required to load C++ extensions (pip install ninja to get it)\n":
            "RuntimeError: Ninja is required to load C++ extensions (pip install ninja to get "
            "it)",
    }
    for output, cause in cases.items():
        assert compiling._cause(output) == cause
    assert len(compiling._cause("x.cpp:1:1: error: " + "y" * 2000)) <= 500


# ------------------------------------------------------------------------------------------
# 6. Prebuilt kernels: a directory of portable variants, searched first, never written to

def test_build_into_leaves_a_verified_variant_and_keeps_it(
        prebuilt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    entry = _baseline(prebuilt_dir)
    assert entry.problem is None and entry.runs and entry.state == "built"
    directory = entry.library.parent
    assert directory.name.startswith("torch") and "-baseline-" in directory.name
    names = {p.name for p in entry.library.parent.iterdir()}
    assert {entry.library.name, entry.library.name + ".sha256", "build.log"} <= names
    assert not [n for n in names if n.endswith((".o", ".obj"))]  # no object files shipped
    before = entry.library.stat().st_mtime_ns
    assert main(BUILD_INTO) == 0  # a second time: kept, not rebuilt
    out, err = capsys.readouterr()
    assert "compiling" not in err and entry.library.stat().st_mtime_ns == before
    assert "baseline:" in out and f"RELPOS_KERNELS_DIR={PREBUILT}" in out, out


def test_a_relative_kernels_directory_reaches_the_builder_as_an_absolute_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder runs inside the variant's directory: ``relpos kernels --build --into
    kernels`` (a relative directory) must name it absolute, or the builder looks for
    kernels/<variant>/ inside itself and the build fails."""
    monkeypatch.chdir(tmp_path)
    spec = compiling._spec(Path("kernels") / "v", build.Target("baseline"))
    assert spec["directory"] == str(tmp_path / "kernels" / "v")


# The decode ops' plain loops (the baseline variant has no vector code): against float64.
DECODE_OPS = textwrap.dedent("""
    import json, torch, torch.nn.functional as F
    from relpos.ops.native.build import load
    m = load()
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(37, 21, generator=g), torch.randn(37, generator=g)
    x = torch.randn(11, 21, generator=g)
    panels = m.panel_linear(x, m.pack_panels(w), b, 37).double()
    q, k = torch.randn(2, 3, 17, generator=g), torch.randn(2, 3, 9, 17, generator=g)
    v = torch.randn(2, 3, 9, 5, generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False
    truth = F.scaled_dot_product_attention(q.double().unsqueeze(2), k.double(), v.double(),
                                           attn_mask=mask[:, None, None, :]).squeeze(2)
    errs = {"panels": float((panels - F.linear(x.double(), w.double(), b.double())).abs().max()),
            "attention": float((m.decode_attention(q, k, v, mask).double() - truth).abs().max())}
    print(json.dumps({"library": m.__file__, "errs": errs}))
""")


def test_the_baseline_variant_runs_the_decode_ops_on_plain_loops(shipped: Path) -> None:
    """The panel linears and the decode attention without vector code (the baseline variant,
    every x86-64 CPU): float64's results to float32 rounding."""
    done = subprocess.run([sys.executable, "-c", DECODE_OPS], capture_output=True, text=True,
                          env={**os.environ, "RELPOS_KERNELS_DIR": str(shipped)}, cwd=ROOT,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "-baseline-" in result["library"], result
    assert result["errs"]["panels"] < 1e-5 and result["errs"]["attention"] < 1e-6, result


def test_a_read_only_prebuilt_directory_serves_a_machine_without_compiler_or_cache(
        shipped: Path) -> None:
    # What a container image without a compiler does: RELPOS_KERNELS_DIR read-only, the user
    # cache impossible to create (inside the read-only directory), no C++ compiler.
    _make_read_only(shipped)
    before = _snapshot(shipped)
    prelude, kwargs = _read_only_child()
    done, result = _run({"RELPOS_KERNELS_DIR": str(shipped), "CXX": "/nonexistent",
                         "RELPOS_CACHE_DIR": str(shipped / "cache")}, prelude, **kwargs)
    assert _native_without_warnings(result), (result, done.stderr)
    assert Path(result["library"]).parent.parent == shipped, result
    assert "-baseline-" in result["library"] and "compiling" not in done.stderr
    assert _snapshot(shipped) == before


def test_a_damaged_prebuilt_variant_is_skipped_with_one_warning_and_the_cache_serves(
        shipped: Path, built: Path, tmp_path: Path) -> None:
    _damage(_baseline(shipped).library, "truncated")
    _make_read_only(shipped)
    before = _snapshot(shipped)
    cache = tmp_path / "cache"
    _copy(built, cache)  # the user cache holds this machine's build
    prelude, kwargs = _read_only_child()
    _, result = _run({"RELPOS_KERNELS_DIR": str(shipped), "RELPOS_CACHE_DIR": str(cache)},
                     prelude, **kwargs)
    assert result["backend"] == "native" and len(result["warnings"]) == 1, result
    warning = result["warnings"][0]
    assert "RELPOS_KERNELS_DIR" in warning and "baseline" in warning, warning
    assert "damaged" in warning and "user cache" in warning, warning
    assert Path(result["library"]).parent == cache / "kernels" / built.name
    assert _snapshot(shipped) == before


def test_a_damaged_prebuilt_variant_without_compiler_says_both_in_one_warning(
        shipped: Path, tmp_path: Path) -> None:
    _damage(_baseline(shipped).library, "overwritten")
    _, result = _run({"RELPOS_KERNELS_DIR": str(shipped), "CXX": "/nonexistent",
                      "RELPOS_CACHE_DIR": str(tmp_path / "cache")})
    assert result["backend"] != "native" and len(result["warnings"]) == 1, result
    warning = result["warnings"][0].splitlines()[0]
    assert "baseline" in warning and "damaged" in warning, warning
    assert "C++ compiler was not found" in warning, warning


def test_a_prebuilt_directory_without_a_build_for_this_torch_warns_once(
        tmp_path: Path, built: Path) -> None:
    empty = tmp_path / "prebuilt"
    empty.mkdir()
    cache = tmp_path / "cache"
    _copy(built, cache)
    _, result = _run({"RELPOS_KERNELS_DIR": str(empty), "RELPOS_CACHE_DIR": str(cache)})
    assert result["backend"] == "native" and len(result["warnings"]) == 1, result
    assert "holds no build of this relpos for torch" in result["warnings"][0], result


def test_the_best_variant_this_cpu_runs_serves_and_a_damaged_better_one_is_said(
        shipped: Path, built: Path, monkeypatch: pytest.MonkeyPatch,
        in_process_cache: Path) -> None:
    # As on a CPU that runs every variant: avx512 is damaged, avx2 absent, baseline sound.
    monkeypatch.setattr(kernels_dir, "runnable", lambda variant: True)
    avx512 = build.Target("avx512")
    damaged = build.library_path(shipped / avx512.directory_name, avx512)
    damaged.parent.mkdir()
    shutil.copy2(build.library_path(built), damaged)
    damaged.with_name(damaged.name + ".sha256").write_text("0" * 64 + "\n")
    monkeypatch.setenv("RELPOS_KERNELS_DIR", str(shipped))
    with pytest.warns(RuntimeWarning, match="skipped avx512: .* damaged.*the baseline build "
                                             "serves"):
        module = build.load()
    assert module is not None and Path(str(module.__file__)) == _baseline(shipped).library
    states = {p.variant: p.state for p in build.status().prebuilt}
    assert states["avx2"] == "absent" and states["baseline"] == "built"
    assert states["avx512"].startswith("damaged"), states
    assert build.status().serving == _baseline(shipped)


def test_relpos_kernels_lists_the_prebuilt_variants(
        shipped: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    monkeypatch.setenv("RELPOS_KERNELS_DIR", str(shipped))
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert f"prebuilt:       {shipped}" in out and "the baseline build serves" in out, out
    assert "  baseline:       built" in out, out
    # The first line says what serves this process, not the user cache's state alone.
    first = out.splitlines()[0]
    assert first == (f"native kernels: the prebuilt baseline variant serves (from "
                     f"RELPOS_KERNELS_DIR {shipped})"), out


@pytest.mark.parametrize(("argv", "fragment"), [
    (["kernels", "--into", "DIR"], "--into and --variants go with --build"),
    (["kernels", "--build", "--variants", "baseline"], "--variants goes with --into DIR"),
    (["kernels", "--build", "--into", "DIR", "--variants", "avx9"],
     "unknown variant(s) ['avx9']; allowed: amx, avx512bf16, avx512, avx2, baseline"),
    (["kernels", "--build", "--into", "FILE"], "that is a file, not a directory"),
    (["kernels", "--prune", "-1"], "argument --prune: must be a finite number >= 0, got '-1'"),
    (["kernels", "--prune", "soon"], "argument --prune: must be a finite number >= 0, got "
                                     "'soon'"),
])
def test_relpos_kernels_refuses_bad_options_in_one_line(
        argv: list[str], fragment: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("DIR", "FILE") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("relpos: error: ") and fragment in err, err
    assert not (tmp_path / "DIR").exists()


# ------------------------------------------------------------------------------------------
# 7. Pruning: the builds of other relpos or torch versions go, nothing else does

def test_relpos_kernels_prune_removes_only_other_builds_and_the_kernels_still_load(
        in_process_cache: Path, built: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    current = _copy(built, in_process_cache)
    kernels = current.parent
    stale = [_stale_build(kernels, STALE[0], 1_500_000), _stale_build(kernels, STALE[1], 500_000)]
    leftover = _stale_build(kernels, f".pruning-{STALE[0]}-77", 1000)  # a killed prune's
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "data").write_text("kept")
    kept = [kernels / "notes", kernels / "torch-mine", kernels / "torch2.13.0-x-0123456789abcdef"]
    kept[0].mkdir()
    kept[1].mkdir()
    kept[2].write_text("a file named like a build")
    (kernels / "torch2.11.0-x-00000000000000ff").symlink_to(outside)
    kept.append(kernels / "torch2.11.0-x-00000000000000ff")

    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "other builds:   3 in the cache, 2.0 MB" in out, out

    assert main(["kernels", "--prune"]) == 0
    out = capsys.readouterr().out
    assert ("pruned:         3 builds of other relpos or torch versions or CPUs from the cache, "
            "2.0 MB") in out, out
    assert "native kernels: built" in out and "other builds" not in out, out
    assert not any(d.exists() for d in (*stale, leftover))
    assert all(p.exists() for p in kept) and (outside / "data").read_text() == "kept"
    assert build._problem(build.library_path(current)) is None
    assert main(["kernels", "--prune"]) == 0  # nothing left to prune
    assert "pruned:         0 builds" in capsys.readouterr().out
    # a new process loads the kept build as it is (no build, no warning) and stamps its use
    month_ago = time.time() - 30 * 86400
    os.utime(current / "build.lock", (month_ago, month_ago))
    done, result = _run({"RELPOS_CACHE_DIR": str(in_process_cache)})
    assert _native_without_warnings(result) and "compiling" not in done.stderr, done.stderr
    assert result["library"] == str(build.library_path(current))
    assert time.time() - (current / "build.lock").stat().st_mtime < TIMEOUT + 5


@pytest.mark.skipif(not LINUX, reason="flock semantics checked on Linux")
def test_prune_leaves_a_build_whose_lock_a_process_holds(in_process_cache: Path) -> None:
    import fcntl

    directory = _stale_build(in_process_cache / "kernels", STALE[0], 10)
    fd = os.open(directory / "build.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (found,) = build.prune()
        assert found.name == STALE[0] and found.kept is not None and "in use" in found.kept
        assert directory.is_dir()
    finally:
        os.close(fd)
    (found,) = build.prune()
    assert found.kept is None and not directory.exists()


@pytest.mark.skipif(not LINUX, reason="flock semantics checked on Linux")
def test_a_process_waiting_on_a_build_lock_a_prune_moved_away_takes_the_new_one(
        tmp_path: Path) -> None:
    """A loader that waited on a build's lock while a prune moved the build aside must not
    build under a lock on the moved file: it takes the lock at the path again."""
    import threading

    directory = tmp_path / "kernels" / STALE[0]
    holder = build._FileLock(directory / "build.lock")
    holder.__enter__()
    waiter = build._FileLock(directory / "build.lock")
    thread = threading.Thread(target=waiter.acquire, daemon=True)
    thread.start()
    time.sleep(0.2)  # the waiter blocks on the lock
    assert thread.is_alive()
    directory.rename(directory.with_name(f".pruning-{STALE[0]}-1"))  # as prune() does
    holder.release()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the waiter never took the lock"
    try:
        assert waiter.exclusive and waiter.fd is not None
        here, held = os.stat(directory / "build.lock"), os.fstat(waiter.fd)
        assert (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)
    finally:
        waiter.release()


def test_build_into_with_prune_removes_the_other_versions_variants(
        shipped: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    old = _stale_build(shipped, "torch2.12.0_cpu-x86_64-baseline-0123456789abcdef", 2_000_000)
    (shipped / "README").write_text("ours")
    assert main(["kernels", "--build", "--into", str(shipped), "--variants", "baseline",
                 "--prune"]) == 0
    out, err = capsys.readouterr()
    assert "compiling" not in err, err
    assert (f"pruned:         1 build of other relpos or torch versions or CPUs from {shipped}, "
            "2.0 MB") in out, out
    assert not old.exists() and (shipped / "README").read_text() == "ours"
    assert _baseline(shipped).state == "built"


def test_prune_with_days_keeps_the_builds_loaded_since(
        in_process_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In a cache machines share, ``--prune DAYS`` keeps what a process loaded in the last DAYS
    days (each load stamps the build's lock; older builds: their newest file)."""
    from relpos.cli import main

    kernels = in_process_cache / "kernels"
    ages = {STALE[0]: 10.0, STALE[1]: 1 / 24}  # days since the last load
    for name, days in ages.items():
        directory = _stale_build(kernels, name, 1_000_000)
        then = time.time() - days * 86400
        for f in directory.iterdir():
            os.utime(f, (then, then))
    assert main(["kernels"]) == 0
    assert "other builds:   2 in the cache, 2.0 MB, the latest loaded 1 hour ago" \
        in capsys.readouterr().out
    assert main(["kernels", "--prune", "7"]) == 0
    out = capsys.readouterr().out
    assert "pruned:         1 build of other relpos or torch versions or CPUs from the cache, " \
        "1.0 MB" in out, out
    assert f"  kept {STALE[1]}: loaded 1 hour ago" in out, out
    assert not (kernels / STALE[0]).exists() and (kernels / STALE[1]).is_dir()
    assert main(["kernels", "--prune"]) == 0  # no DAYS: every other build
    assert not (kernels / STALE[1]).exists()


@pytest.mark.parametrize(("days", "words"), [
    (0.0, "0 minutes ago"), (1 / 1440, "1 minute ago"), (0.5, "12 hours ago"),
    (1 / 24, "1 hour ago"), (1.9, "46 hours ago"), (2.0, "2 days ago"), (1.0, "24 hours ago"),
    (40.4, "40 days ago")])
def test_a_builds_last_use_in_words(days: float, words: str) -> None:
    assert build.Pruned("b", 0, days).last_used == words


def test_a_lock_on_a_file_system_whose_inodes_move_is_kept_after_its_tries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the locked file never looks like the one at the path (unstable inode numbers),
    the lock is taken after a bounded number of tries instead of looping forever."""
    checks = []

    def moved(self: build._FileLock) -> bool:
        checks.append(1)
        return False

    monkeypatch.setattr(build._FileLock, "_still_in_place", moved)
    lock = build._FileLock(tmp_path / "build.lock")
    with lock:
        assert lock.exclusive or not LINUX
    assert len(checks) == compiling._LOCK_ATTEMPTS or not LINUX
