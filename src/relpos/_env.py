"""relpos's environment switches, read one way: a value is stripped and lower-cased; unset or
empty means the default; a value that is none of those allowed means the default too, said in
one warning (per value and process) that names the values allowed and what serves instead.
No such switch makes a call fail. The exceptions are the native kernels' two GEMM switches
(:func:`strict_choice`), which the kernels read themselves and which name an engine: a value
that names none is refused with a ValueError, never run on an engine other than the one asked
for. A switch that no longer has an effect is said once (:func:`removed`).

Nothing here imports torch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

__all__ = ["FLAG_WORDS", "choice", "flag", "path", "removed", "strict_choice", "watch"]

#: The words a yes/no switch takes, and the value each stands for.
FLAG_WORDS: Mapping[str, str] = {"1": "1", "true": "1", "on": "1", "yes": "1",
                                 "0": "0", "false": "0", "off": "0", "no": "0"}

_warned: set[tuple[str, str]] = set()


def choice(name: str, allowed: Iterable[str], *, default: str = "", fallback: str,
           aliases: Mapping[str, str] | None = None) -> str:
    """The value of the switch ``name``: stripped and lower-cased (``aliases`` maps other
    spellings to values), one of ``allowed``; ``default`` when it is unset or empty, and when
    it is none of ``allowed``, then with one RuntimeWarning naming them and ``fallback`` (what
    serves instead).

    Example:
        >>> os.environ["RELPOS_EXAMPLE"] = " Blas "
        >>> choice("RELPOS_EXAMPLE", ("vec", "blas"), fallback="the default")
        'blas'
        >>> del os.environ["RELPOS_EXAMPLE"]
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if not value:
        return default
    value = (aliases or {}).get(value, value)
    allowed = tuple(allowed)
    if value in allowed:
        return value
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        words = (*allowed, *(a for a in aliases or () if a not in allowed))
        warnings.warn(f"relpos: {name}={raw!r} is none of {', '.join(words)} (or unset); it is "
                      f"ignored: {fallback}.", RuntimeWarning, stacklevel=2)
    return default


def strict_choice(name: str, allowed: Iterable[str]) -> str:
    """The value of the switch ``name``, stripped and lower-cased, one of ``allowed``; "" when
    it is unset or empty; a ValueError naming the variable, the value given and those allowed
    when it is none of them.

    Example:
        >>> os.environ["RELPOS_EXAMPLE"] = " Brgemm "
        >>> strict_choice("RELPOS_EXAMPLE", ("vec", "brgemm"))
        'brgemm'
        >>> del os.environ["RELPOS_EXAMPLE"]
    """
    raw = os.environ.get(name)
    value = (raw or "").strip().lower()
    allowed = tuple(allowed)
    if value and value not in allowed:
        raise ValueError(f"relpos: {name}={raw!r} is none of {', '.join(allowed)} (or unset); "
                         f"set {name} to one of them, or unset it")
    return value


def removed(name: str, instead: str) -> None:
    """Say once per process, where the variable ``name`` is set (whatever its value), that it
    no longer has an effect and what replaces it (``instead``)."""
    if os.environ.get(name) is None or (name, "") in _warned:
        return
    _warned.add((name, ""))
    warnings.warn(f"relpos: {name} no longer has an effect; instead: {instead}.",
                  RuntimeWarning, stacklevel=3)


def flag(name: str, *, default: bool, fallback: str) -> bool:
    """The yes/no switch ``name`` (:data:`FLAG_WORDS`: ``1``/``true``/``on``/``yes``,
    ``0``/``false``/``off``/``no``), read as :func:`choice` reads one."""
    value = choice(name, ("0", "1"), default="1" if default else "0", fallback=fallback,
                   aliases=FLAG_WORDS)
    return value == "1"


def path(name: str) -> Path | None:
    """The directory the variable ``name`` names (stripped, ``~`` expanded), or None when it
    is unset or empty."""
    given = os.environ.get(name, "").strip()
    return Path(given).expanduser() if given else None


def watch(names: tuple[str, ...]) -> Callable[[], tuple[object, ...]]:
    """A function giving the raw values of the variables ``names``, cheaply: to tell on every
    call whether any changed (a few hundred nanoseconds for several, where ``os.environ.get``
    takes most of a microsecond each)."""
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or not isinstance(data, dict):  # pragma: no cover - not POSIX
        return lambda: tuple(map(os.environ.get, names))
    keys, get = tuple(map(os.fsencode, names)), data.get
    return lambda: tuple(map(get, keys))
