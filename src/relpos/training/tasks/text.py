"""Character-level text: :class:`TextLM` (``text``), windows or lines of a user's UTF-8 file;
see :mod:`relpos.training.tasks`."""


from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from relpos.training.tasks.base import SPLITS, Batch, Task, _stream_seed

__all__ = ["TEXT_UNITS", "TextLM"]


#: The example units of :class:`TextLM`.
TEXT_UNITS = ("window", "line")


class TextLM(Task):
    """Next-character prediction on a UTF-8 text file.

    The vocabulary is the sorted set of characters of the whole file. The first
    ``1 - valid_fraction`` of the text is the train split, the rest the eval split.

    Units of an example:

    * ``"window"``: a random window of ``L + 1`` characters of the split (ids its first L,
      targets its last L); a batch is ``(batch_size, L)``, every position scored.
    * ``"line"``: a random line of the split (its characters, the trailing newline
      included; lines of fewer than 2 characters are skipped, so a row holds at least one
      token), ids ``line[:-1]`` and targets ``line[1:]``; a line longer than ``L + 1``
      characters gives a random window of ``L + 1`` of them. A batch draws lines until it
      holds exactly ``batch_size * L`` tokens, the budget: the last line drawn is cut to
      fit, so every batch trains on the same number of tokens while its number of rows
      varies (at least ``batch_size``, since no row holds more than L tokens). Rows are
      padded on the right to the longest (ids 0, unscored) with ``key_mask`` False there.

    Args:
        path: the text file.
        valid_fraction: the share of the text held out for evaluation, in (0, 1).
        unit: ``"window"`` (default) or ``"line"``.

    Raises:
        FileNotFoundError: if the file does not exist.
        IsADirectoryError: if it is a directory.
        ValueError: if it is not UTF-8 text, too short to split, an unknown ``unit``, or
            (``"line"``) a split without a line of 2 characters or more.
    """

    name = "text"
    causal_only = True
    breakdown = None

    def __init__(
        self, path: str | Path, *, valid_fraction: float = 0.1, unit: str = "window"
    ) -> None:
        if unit not in TEXT_UNITS:
            raise ValueError(f"unit must be one of {', '.join(map(repr, TEXT_UNITS))}, "
                             f"got {unit!r}")
        self.unit = unit
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(f"text file {str(self.path)!r} is a directory; allowed: a "
                                    "UTF-8 text file")
        if not self.path.is_file():
            raise FileNotFoundError(f"text file {str(self.path)!r} does not exist")
        if not 0.0 < valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction!r}")
        self.valid_fraction = float(valid_fraction)
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"text file {str(self.path)!r} is not UTF-8: {err}") from None
        self.chars = sorted(set(text))
        if len(self.chars) < 2:
            raise ValueError(
                f"text file {str(self.path)!r} needs at least 2 distinct characters, "
                f"got {len(self.chars)}"
            )
        index = {c: n for n, c in enumerate(self.chars)}
        data = [index[c] for c in text]
        cut = int(len(data) * (1.0 - self.valid_fraction))
        self._splits = {"train": data[:cut], "eval": data[cut:]}
        #: split -> (start, size) of each line of 2 characters or more (``unit="line"``).
        self._lines: dict[str, list[tuple[int, int]]] = {}
        if unit == "line":
            for split, (start, stop) in (("train", (0, cut)), ("eval", (cut, len(text)))):
                self._lines[split] = _line_spans(text, start, stop)
                if not self._lines[split]:
                    raise ValueError(
                        f"text file {str(self.path)!r} has no line of 2 characters or more "
                        f"in its {split} split (characters {start}..{stop - 1}); unit 'line' "
                        "needs one in each split"
                    )

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def variable_length(self) -> bool:
        return self.unit == "line"

    def min_length(self) -> int:
        return 1

    def max_length(self) -> int:
        """The longest length both splits can fill (each example needs L + 1 chars)."""
        return min(len(s) for s in self._splits.values()) - 1

    def config(self) -> dict[str, Any]:
        """As :meth:`Task.config`, with ``unit`` where it is not ``"window"`` (a config
        without it, as written before units existed, means windows)."""
        config: dict[str, Any] = {
            "name": self.name,
            "path": str(self.path),
            "valid_fraction": self.valid_fraction,
        }
        if self.unit != "window":
            config["unit"] = self.unit
        config["chars"] = "".join(self.chars)
        return config

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, *, seed: int, step: int, batch_size: int, length: int, split: str) -> Batch:
        """As :meth:`Task.batch`; with ``unit="line"`` a batch of lines holding
        ``batch_size * length`` tokens: ``(N, M)`` tensors with ``key_mask``, N >=
        ``batch_size`` rows of at most ``length`` tokens, M the longest row."""
        if self.unit == "line":
            self._check_request(batch_size=batch_size, length=length, split=split)
            return self._line_batch(seed=seed, step=step, budget=batch_size * length,
                                    length=length, split=split)
        if split in SPLITS and length > self.max_length():
            raise ValueError(
                f"text file {str(self.path)!r} is too short for length {length}: each split "
                f"must hold length + 1 characters (the longest possible length is "
                f"{max(self.max_length(), 0)})"
            )
        return super().batch(
            seed=seed, step=step, batch_size=batch_size, length=length, split=split
        )

    def _example(
        self, rng: random.Random, length: int, split: str
    ) -> tuple[list[int], list[int], list[bool], dict[str, list[int]]]:
        data = self._splits[split]
        start = rng.randrange(len(data) - length)
        window = data[start : start + length + 1]
        return window[:-1], window[1:], [True] * length, {}

    def _line_batch(self, *, seed: int, step: int, budget: int, length: int,
                    split: str) -> Batch:
        """Random lines of ``split`` (each at most ``length + 1`` characters) until they
        hold ``budget`` tokens, the last one cut to fit; padded on the right."""
        rng = random.Random(_stream_seed(self.name, "line", seed, split, step, length))
        data, spans = self._splits[split], self._lines[split]
        rows: list[list[int]] = []
        left = budget
        while left > 0:
            start, size = spans[rng.randrange(len(spans))]
            if size > length + 1:  # a random window of length + 1 characters
                start += rng.randrange(size - length)
                size = length + 1
            size = min(size, left + 1)  # the budget's last tokens
            rows.append(data[start : start + size])
            left -= size - 1
        longest = max(len(r) for r in rows) - 1
        ids = torch.tensor([r[:-1] + [0] * (longest + 1 - len(r)) for r in rows],
                           dtype=torch.long)
        targets = torch.tensor([r[1:] + [0] * (longest + 1 - len(r)) for r in rows],
                               dtype=torch.long)
        lengths = torch.tensor([len(r) - 1 for r in rows])
        key_mask = torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)
        return Batch(ids, targets, key_mask.clone(), {}, key_mask)


def _line_spans(text: str, start: int, stop: int) -> list[tuple[int, int]]:
    """``(offset from start, size)`` of each line of ``text[start:stop]`` (its newline
    included; the last line may have none) of 2 characters or more."""
    spans = []
    pos = start
    while pos < stop:
        end = text.find("\n", pos, stop)
        end = stop if end < 0 else end + 1
        if end - pos >= 2:
            spans.append((pos - start, end - pos))
        pos = end
    return spans
