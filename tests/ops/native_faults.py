"""What the native kernels' fault tests share (tests/ops/test_native_build.py,
tests/ops/test_native_faults.py): a call in a child process under a hard timeout, the suite's
build and baseline variant, copies of them to damage, and a stand-in ``g++``.

One build is real: the suite's baseline variant in build/relpos-prebuilt (``relpos kernels
--build --into``, once for the suite). Otherwise no test compiles: the cached build of the
suite (tests/conftest.py, build/relpos-cache) is copied into a temporary cache, and where a
build must run, a stand-in ``g++`` (FAKE_GXX) "compiles" under ninja and torch's
cpp_extension as a real one would, its "link" copying the suite's library into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from relpos.ops.native import build

ROOT = Path(__file__).resolve().parents[2]
#: Seconds any child process of these tests may take: a call that hangs (waiting on a baton
#: nobody will release) fails the test instead of hanging CI. With a build faked, a call
#: takes a few seconds (two interpreters importing torch).
TIMEOUT = 60
LINUX = sys.platform.startswith("linux")

# A stand-in for g++ that torch accepts (named g++, version 12.2.0): a compile writes an empty
# object and its dependency file, a link copies $FAKE_CXX_LIBRARY (the suite's real library)
# to its output. $FAKE_CXX_PIDS collects the pid of every compile or link; $FAKE_CXX_SLEEP
# makes each take that long.
FAKE_GXX = """\
#!/bin/sh
for arg in "$@"; do
  case "$arg" in -dumpfullversion|-dumpversion) echo 12.2.0; exit 0;; esac
done
[ -n "$FAKE_CXX_PIDS" ] && echo $$ >> "$FAKE_CXX_PIDS"
[ -n "$FAKE_CXX_SLEEP" ] && sleep "$FAKE_CXX_SLEEP"
out=; dep=; prev=; shared=
for arg in "$@"; do
  [ "$prev" = "-o" ] && out=$arg
  [ "$prev" = "-MF" ] && dep=$arg
  [ "$arg" = "-shared" ] && shared=1
  prev=$arg
done
if [ -n "$shared" ]; then
  cp "$FAKE_CXX_LIBRARY" "$out"
else
  : > "$out"
  [ -n "$dep" ] && echo "$out:" > "$dep"
fi
exit 0
"""

# One call through auto-selection, checked against the reference in float64; prints the
# backend that served it and the warnings it raised (JSON, the last line of stdout).
CALL = textwrap.dedent("""
    import json, warnings, torch, relpos
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.randn(5, 4, generator=g, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = relpos.relative_attention(q, k, v, max_distance=2, rel_keys=t, rel_values=t)
        backend = relpos.select_backend(q, k, v, max_distance=2, rel_keys=t, rel_values=t)
    ref = relpos.relative_attention(q, k, v, max_distance=2, rel_keys=t, rel_values=t,
                                    implementation="reference")
    assert torch.allclose(out, ref, rtol=0, atol=1e-12), (out - ref).abs().max()
    from relpos.ops.native import build, compiling, kernels_dir
    module = build.load(quiet=True)
    library = module.__file__ if module is not None and backend == "native" else None
    print(json.dumps({"backend": backend, "warnings": [str(w.message) for w in caught],
                      "library": library}))
""")


def _run(env: dict[str, str], prelude: str = "",
         **kwargs: object) -> tuple[subprocess.CompletedProcess[str], dict]:
    """CALL (after ``prelude``) in a child process (``env`` added to this one's), under
    TIMEOUT; its result."""
    try:
        done = subprocess.run([sys.executable, "-c", prelude + CALL], capture_output=True,
                              text=True,
                              env={**os.environ, **env}, cwd=ROOT, timeout=TIMEOUT,
                              **kwargs)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the call did not finish within {TIMEOUT} s: {hung.stderr!r}")
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done, json.loads(done.stdout.strip().splitlines()[-1])


def _native_without_warnings(result: dict) -> bool:
    return result["backend"] == "native" and result["warnings"] == []


@pytest.fixture(scope="module")
def built() -> Path:
    """The suite's build directory: built (once for the suite) and verified."""
    assert build.load(quiet=True) is not None, build.failure()
    assert build.status().built
    return build.build_directory()


@pytest.fixture
def library(built: Path, tmp_path: Path) -> Path:
    """A private copy of the suite's library (what FAKE_GXX links)."""
    return Path(shutil.copy2(build.library_path(built), tmp_path / "good.so"))


@pytest.fixture
def fake_gxx(tmp_path: Path, library: Path) -> dict[str, str]:
    """The environment of a child process whose C++ compiler is FAKE_GXX."""
    (tmp_path / "bin").mkdir()
    gxx = tmp_path / "bin" / "g++"
    gxx.write_text(FAKE_GXX)
    gxx.chmod(0o755)
    return {"CXX": str(gxx), "FAKE_CXX_LIBRARY": str(library)}


def _copy(built: Path, cache: Path) -> Path:
    """The suite's build directory copied whole (ninja's state too, mtimes kept) into the
    cache ``cache``; the copy's path."""
    target = cache / "kernels" / built.name
    shutil.copytree(built, target, ignore=shutil.ignore_patterns("lock", "build.session"))
    return target

@pytest.fixture
def in_process_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """RELPOS_CACHE_DIR at a fresh cache for calls in this process, no build loaded yet."""
    monkeypatch.setenv("RELPOS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_failure", None)
    monkeypatch.setattr(build, "_failure_log", None)
    return tmp_path / "cache"

def _damage(library: Path, how: str) -> None:
    size = library.stat().st_size
    with open(library, "r+b") as handle:
        if how == "truncated":  # dlopen: SIGBUS
            handle.truncate(size // 2)
        else:  # the ELF header kept, the rest overwritten: dlopen: SIGSEGV
            handle.seek(4096)
            handle.write(bytes(range(251)) * ((size - 8192) // 251))


def _rehash(library: Path, *, size: int | None = None) -> None:
    """Record the library's present sha256 as ``sha256sum lib > lib.sha256`` does (with
    ``size``: the size line of the build's record kept, as by an edit of the hash alone)."""
    digest = hashlib.sha256(library.read_bytes()).hexdigest()
    build._checksum_path(library).write_text(
        f"{digest}  {library.name}\n" + (f"# size={size}\n" if size is not None else ""))

def _remove(root: Path) -> None:
    """``root`` made writable again, and removed."""
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    shutil.rmtree(root)


def _snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes() if p.is_file()
                     else b"") for p in sorted(root.rglob("*"))}

def _make_read_only(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            os.chmod(os.path.join(folder, name), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(folder, 0o555)

PREBUILT = ROOT / "build" / "relpos-prebuilt"
BUILD_INTO = ["kernels", "--build", "--into", str(PREBUILT), "--variants", "baseline"]


@pytest.fixture(scope="session")
def prebuilt_dir() -> Path:
    """The suite's kernels directory: the baseline variant (every CPU of this architecture runs
    it) built by ``relpos kernels --build --into`` (once for the suite, under its lock)."""
    from relpos.cli import main

    assert main(BUILD_INTO) == 0
    return PREBUILT


def _baseline(root: Path) -> build.Prebuilt:
    (entry,) = [p for p in build.prebuilt(root) if p.variant == "baseline"]
    return entry


@pytest.fixture
def shipped(prebuilt_dir: Path) -> Iterator[Path]:
    """A kernels directory as an image ships it: the suite's baseline build (library, checksum,
    log) alone, in a directory any user can read; made read-only by the test."""
    root = Path(tempfile.mkdtemp(prefix="relpos-prebuilt-"))
    try:
        root.chmod(0o755)
        variant = _baseline(prebuilt_dir).library.parent
        shutil.copytree(variant, root / variant.name)
        yield root
    finally:
        _remove(root)

STALE = ("torch2.12.0_cpu-x86_64-AVX512-0123456789abcdef",  # another torch
         "torch2.13.0_cpu-x86_64-AVX2-fedcba9876543210")  # other sources or another CPU


def _stale_build(root: Path, name: str, size: int) -> Path:
    """A build directory as an older relpos left it: a library of ``size`` bytes, its
    checksum, its lock."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / f"relpos_native_{name[-16:]}.so").write_bytes(b"\0" * size)
    (directory / f"relpos_native_{name[-16:]}.so.sha256").write_text("0" * 64 + "\n")
    (directory / "build.lock").write_text("")
    return directory
