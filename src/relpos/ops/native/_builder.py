"""The build of the native kernels, run by :mod:`.build` in a child process of its own.

``python _builder.py SPEC`` (SPEC: JSON with the module's name, sources, build directory,
flags, the parent's pid and whether to load the result) compiles the kernels with
``torch.utils.cpp_extension.load``, loads them once (a damaged library crashes this process,
not the user's; a variant for another CPU is not loaded), and exits 0.

The child is the leader of its own session, and every process of the build (ninja, which
puts each compile in a process group of its own, the compiler driver, ``cc1plus``, ``as``)
stays in that session. So the build dies as a whole: on SIGTERM, SIGINT or SIGHUP, and on
Linux when the parent dies (any signal, SIGKILL included: ``PR_SET_PDEATHSIG``), the child
kills every other process of its session with SIGKILL, then exits. The parent does the
same with :func:`kill_session` once the child is gone (killed itself, say), for the processes
that work in the build directory. Elsewhere than Linux (no ``/proc``, no
``PR_SET_PDEATHSIG``) the child's process group gets SIGTERM, which ninja passes on to its
compiles; a child whose parent was killed with SIGKILL finishes the build.

Run as a script by path, it imports only the standard library and torch: no ``relpos``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from types import FrameType

__all__ = ["kill_session", "session_members"]

_PR_SET_PDEATHSIG = 1


def session_members(sid: int, *, cwd: str | None = None) -> list[int]:
    """The live processes of session ``sid`` (not this one; zombies are dead), those whose
    working directory is ``cwd`` when given (Linux: read from ``/proc``; elsewhere none)."""
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
            # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] in ("Z", "X") or int(fields[3]) != sid:
                continue
            if cwd is not None and not os.path.samefile(f"/proc/{name}/cwd", cwd):
                continue
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        members.append(int(name))
    return members


def kill_session(sid: int, *, cwd: str | None = None, wait_s: float = 5.0) -> list[int]:
    """SIGKILL every process of session ``sid`` but this one (those working in ``cwd`` when
    given), and wait up to ``wait_s`` for them to die; the pids killed. Where ``/proc`` is
    missing (not Linux), the process group ``sid`` (a session leader's) gets SIGTERM instead,
    which ninja passes on to its compiles, and only without ``cwd`` (nothing tells which
    processes are the build's)."""
    if not os.path.isdir("/proc"):
        if cwd is None:
            with contextlib.suppress(OSError):
                os.killpg(sid, signal.SIGTERM)
        return []
    killed: list[int] = []
    deadline = time.monotonic() + wait_s
    while True:
        members = session_members(sid, cwd=cwd)
        if not members or time.monotonic() > deadline:
            return killed
        for pid in members:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.02)


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _end(signum: int, frame: FrameType | None = None) -> None:
    """Kill the whole build (this session), then exit as killed by ``signum``."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    kill_session(os.getsid(0))
    os._exit(128 + signum)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        _end(signal.SIGTERM)


def main(argv: list[str]) -> int:
    """Build the kernels SPEC describes (``argv[1]``); 0 when they built and load."""
    spec = json.loads(argv[1])
    for sig in _SIGNALS:
        signal.signal(sig, _end)
    _die_with_parent(int(spec["parent"]))
    from torch.utils import cpp_extension

    if not spec.get("load", True):
        # A variant for another CPU (relpos kernels --build --into): compiled, never loaded
        # here, where it might run an instruction this CPU lacks.
        if not hasattr(cpp_extension, "_import_module_from_library"):
            print("RuntimeError: this torch cannot build a library without loading it; build "
                  "this variant on a CPU that runs it", file=sys.stderr, flush=True)
            return 1
        cpp_extension._import_module_from_library = lambda *args, **kwargs: None
    try:
        module = cpp_extension.load(
            name=spec["name"], sources=spec["sources"], build_directory=spec["directory"],
            extra_cflags=spec["cflags"], extra_ldflags=spec["ldflags"], verbose=False,
        )
    except Exception as error:  # the compiler's output is in the message
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    print(f"relpos: built {spec['name']}" if module is None
          else f"relpos: built and loaded {module.__file__}", flush=True)
    return 0


if __name__ == "__main__":
    # Run by path: this folder (op.py, build.py) must not shadow any module torch imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main(sys.argv))
