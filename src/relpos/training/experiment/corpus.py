"""Real data that ships with every Python: a character-level language model on the source
files of the standard library, with the brackets' long-range dependencies marked.

The corpus is the ``.py`` files under a root directory (by default the running
interpreter's ``Lib/``, ``sysconfig.get_paths()["stdlib"]``), skipping ``site-packages``,
test directories and files over :data:`MAX_FILE_BYTES` (generated data tables such as
``pydoc_data/topics.py``). Each file goes to the train, validation or test split by a fixed
hash of its relative path (:func:`split_of`), so a file never straddles two splits and the
split is the same on every machine and in every run. Nothing is downloaded.

Characters: ASCII code points are their own ids (0-127); every other character becomes id
127 (DEL, which source files do not hold), so one character is one id and offsets in the
text are offsets in the sequence. Files of a split are joined by ``\\x00``.

Long-range targets: every closing bracket ``)``, ``]``, ``}`` outside strings and comments
is matched to its opener (:func:`bracket_pairs`); in a batch, meta ``distance`` is the
distance ``d = closer - opener`` of the closer a position predicts when the opener lies in
the same window (the model can see it), ``-1`` elsewhere.
"""

from __future__ import annotations

import hashlib
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from relpos.training.tasks import Batch, Task, _check_int, _stream_seed

__all__ = [
    "CLOSERS",
    "MAX_FILE_BYTES",
    "SKIP_DIRS",
    "PythonSourceLM",
    "SourceCorpus",
    "bracket_pairs",
    "default_root",
    "find_sources",
    "split_of",
]

#: Directory names whose files are not part of the corpus.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                       "__pycache__"})
#: Files larger than this are skipped (generated tables, not code people write).
MAX_FILE_BYTES = 256 * 1024
#: Percent of files (by path hash) in train / validation; the rest is test.
SPLIT_PERCENT = (80, 10)
SPLIT_NAMES = ("train", "validation", "test")
OOV = 127
SEPARATOR = "\x00"
CLOSERS = {")": "(", "]": "[", "}": "{"}
_CLOSER_IDS = torch.tensor([ord(")"), ord("]"), ord("}")])

# A string (single or triple quoted, escapes honoured), a comment, or a bracket.
_SCAN = re.compile(
    r"""(?P<s>'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"|'(?:\\.|[^'\\\n])*'"""
    r"""|"(?:\\.|[^"\\\n])*")|(?P<c>\#[^\n]*)|(?P<b>[()\[\]{}])""",
    re.DOTALL,
)


def default_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """``"train"``, ``"validation"`` or ``"test"``: a fixed hash of the relative path
    (POSIX separators), the same on every machine."""
    digest = hashlib.blake2b(relative_path.encode("utf-8"), digest_size=8).digest()
    bucket = int.from_bytes(digest, "little") % 100
    if bucket < SPLIT_PERCENT[0]:
        return "train"
    if bucket < SPLIT_PERCENT[0] + SPLIT_PERCENT[1]:
        return "validation"
    return "test"


def find_sources(root: str | Path) -> list[Path]:
    """The corpus files under ``root``, sorted by relative path.

    Raises:
        FileNotFoundError: if ``root`` is not a directory.
        ValueError: if it holds no usable ``.py`` file.
    """
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"corpus root {str(base)!r} is not a directory")
    found = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if SKIP_DIRS & set(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        found.append(path)
    if not found:
        raise ValueError(f"corpus root {str(base)!r} holds no .py files")
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def bracket_pairs(text: str) -> list[tuple[int, int]]:
    """``(opener, closer)`` offsets of the matched brackets of Python source ``text``,
    outside strings and comments, in order of the closers.

    A closer that does not match the innermost open bracket (broken code) empties the
    stack; unclosed openers are dropped.

    Example:
        >>> bracket_pairs("f(a[1], '(')  # )")
        [(3, 5), (1, 11)]
    """
    stack: list[tuple[str, int]] = []
    pairs = []
    for m in _SCAN.finditer(text):
        if m.lastgroup != "b":
            continue
        ch, pos = m.group(), m.start()
        if ch in "([{":
            stack.append((ch, pos))
        elif stack and stack[-1][0] == CLOSERS[ch]:
            pairs.append((stack.pop()[1], pos))
        else:
            stack.clear()
    return pairs


def _encode(text: str) -> torch.Tensor:
    ascii_text = re.sub(r"[^\x00-\x7e]", chr(OOV), text)
    if not ascii_text:
        return torch.zeros(0, dtype=torch.long)  # frombuffer refuses an empty buffer
    return torch.frombuffer(bytearray(ascii_text.encode("ascii")), dtype=torch.uint8).long()


@dataclass
class _Split:
    ids: torch.Tensor  # (N,) long
    distance: torch.Tensor  # (N,) long: closer - opener at closers, 0 elsewhere
    files: int


class SourceCorpus:
    """The files of a corpus root, encoded and split (see the module docstring).

    Args:
        root: the directory (None = :func:`default_root`).

    Attributes:
        root: the directory.
        splits: ``"train"``/``"validation"``/``"test"`` -> encoded text and bracket distances.
        digest: a hash of the relative paths and contents (two corpora with the same digest
            give the same batches).
        non_ascii: the share of characters mapped to the OOV id.
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        files = find_sources(self.root)
        texts: dict[str, list[str]] = {name: [] for name in SPLIT_NAMES}
        digest = hashlib.blake2b(digest_size=16)
        unreadable = 0
        for path in files:
            rel = path.relative_to(self.root).as_posix()
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                unreadable += 1
                continue
            text = text.replace(SEPARATOR, " ")
            digest.update(rel.encode() + b"\x00" + text.encode("utf-8", "surrogatepass"))
            texts[split_of(rel)].append(text)
        # the experiment trains on "train" and evaluates on "validation" ("test" may be empty)
        empty = [name for name in ("train", "validation") if not "".join(texts[name])]
        if empty:
            raise ValueError(
                f"corpus root {str(self.root)!r}: no text for the {' and '.join(empty)} "
                f"split(s) ({len(files)} .py files, {unreadable} of them unreadable or not "
                "UTF-8; files go to train / validation / test by a hash of their path); "
                "allowed: a directory with enough UTF-8 .py files for every split"
            )
        self.digest = digest.hexdigest()
        self.splits: dict[str, _Split] = {}
        oov = total = 0
        for name, parts in texts.items():
            joined = SEPARATOR.join(parts)
            ids = _encode(joined)
            distance = torch.zeros(len(joined), dtype=torch.long)
            pairs = bracket_pairs(joined)
            if pairs:
                pos = torch.tensor(pairs, dtype=torch.long)
                distance[pos[:, 1]] = pos[:, 1] - pos[:, 0]
            self.splits[name] = _Split(ids, distance, len(parts))
            oov += int((ids == OOV).sum())
            total += len(joined)
        self.non_ascii = oov / max(total, 1)
        self.files = len(files)

    def describe(self) -> dict[str, Any]:
        """JSON-able facts: root, digest, files and characters per split."""
        return {
            "root": str(self.root),
            "digest": self.digest,
            "files": {k: v.files for k, v in self.splits.items()},
            "characters": {k: int(v.ids.numel()) for k, v in self.splits.items()},
            "closers": {k: int((v.distance > 0).sum()) for k, v in self.splits.items()},
            "non_ascii_share": self.non_ascii,
        }


class PythonSourceLM(Task):
    """Next-character prediction on Python source (:class:`SourceCorpus`).

    Split ``"train"`` draws windows from the train files, ``"eval"`` from the validation
    files (``"test"`` from the test files; the experiment does not look at them). Every
    position is scored; meta ``distance`` marks the closing-bracket targets (see the
    module docstring).

    Args:
        corpus: the corpus (None = the running interpreter's standard library).
    """

    name = "pysrc"
    causal_only = True
    breakdown = None
    #: Split of the task -> split of the corpus.
    SPLIT_FILES: ClassVar[dict[str, str]] = {"train": "train", "eval": "validation", "test": "test"}

    def __init__(self, corpus: SourceCorpus | None = None) -> None:
        self.corpus = corpus if corpus is not None else SourceCorpus()

    @property
    def vocab_size(self) -> int:
        return 128

    def min_length(self) -> int:
        return 1

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "root": str(self.corpus.root), "digest": self.corpus.digest}

    def _example(self, rng: random.Random, length: int, split: str) -> Any:
        raise NotImplementedError  # batch() draws whole batches

    def batch(self, *, seed: int, step: int, batch_size: int, length: int, split: str) -> Batch:
        """Random windows of ``length + 1`` characters of the split's files.

        Raises:
            ValueError: on an unknown split, or a split shorter than ``length + 1``.
        """
        if split not in self.SPLIT_FILES:
            raise ValueError(f"split must be one of {tuple(self.SPLIT_FILES)}, got {split!r}")
        _check_int(batch_size, "batch_size", 1)
        _check_int(length, "length", 1)
        data = self.corpus.splits[self.SPLIT_FILES[split]]
        n = int(data.ids.numel())
        if n < length + 2:
            raise ValueError(
                f"the {self.SPLIT_FILES[split]} files of {str(self.corpus.root)!r} hold {n} "
                f"characters, too few for length {length}"
            )
        rng = random.Random(_stream_seed(self.name, seed, split, step, length))
        starts = torch.tensor([rng.randrange(n - length - 1) for _ in range(batch_size)])
        index = starts[:, None] + torch.arange(length + 1)  # (B, L + 1)
        window = data.ids[index]
        dist = data.distance[index[:, 1:]]  # the closer each position predicts
        # The opener must lie in the window: closer - d >= start, i.e. d <= t + 1.
        visible = (dist > 0) & (dist <= torch.arange(1, length + 1))
        meta = {"distance": torch.where(visible, dist, torch.full_like(dist, -1))}
        mask = torch.ones(batch_size, length, dtype=torch.bool)
        return Batch(window[:, :-1], window[:, 1:], mask, meta)


def closer_ids() -> torch.Tensor:
    """The ids of ``)``, ``]``, ``}``."""
    return _CLOSER_IDS.clone()
