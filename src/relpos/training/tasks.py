"""Synthetic tasks (and character-level text) for studying the clip distance K.

Every task generates batches on the fly, deterministically: the batch for
``(seed, split, step, length)`` is always the same, whatever ran before it, so a resumed
or distributed run sees exactly the data of an uninterrupted single-process run.

A :class:`Batch` holds ``ids`` (B, L), ``targets`` (B, L), a loss ``mask`` (B, L) (True =
this position is scored) and ``meta``: named (B, L) integer tensors describing each scored
position (for example the dependency distance ``d``), ``-1`` where not applicable, so
accuracy can be broken down by distance. A task of variable-length examples
(:attr:`Task.variable_length`: ``TextLM(unit="line")``) pads its rows on the right to the
batch's longest and adds ``key_mask`` (B, L) (True = real token); the trainer packs such a
batch (:meth:`Batch.packed`), so no compute is spent on the padding.

Tasks:

* :class:`OffsetRecall` (``recall``): random symbols; at a few positions a *probe* token
  ``P_d`` (one per distance ``d``) asks for the symbol exactly ``d`` positions back. The
  symbols are uniform and independent, so content gives no hint: only the offset does.
* :class:`Agreement` (``agree``): clauses "``SUBJ`` noun ... ``VERB``" where the verb must
  agree in number (``SG``/``PL``) with the most recent marked subject, ``d`` tokens back;
  unmarked nouns of random number (attractors) and fillers lie in between, and an earlier
  marked subject always competes, so the nearest one must be found.
* :class:`SortWindows` (``sort``): windows of ``w`` symbols, a separator, then the same
  symbols sorted (next-token prediction of the sorted part). The rule does not depend on
  the sequence length: a test of length generalisation.
* :class:`TextLM` (``text``): next-character prediction on a user's UTF-8 text file, with
  a train/validation split; examples are fixed-length windows (``unit="window"``) or lines
  (``unit="line"``: variable-length rows, batched by a token budget).
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = [
    "SPLITS",
    "TASKS",
    "TEXT_UNITS",
    "Agreement",
    "Batch",
    "OffsetRecall",
    "SortWindows",
    "Task",
    "TextLM",
    "build_task",
    "task_from_config",
]

#: Data splits; each draws from its own independent stream.
SPLITS = ("train", "eval")

#: Default dependency distances of the synthetic tasks (up to 32).
DEFAULT_RECALL_DISTANCES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_AGREE_DISTANCES = (2, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class Batch:
    """One batch of a task.

    Attributes:
        ids: (B, L) long, the input tokens (0 on padding).
        targets: (B, L) long, the token to predict at each position (0 where unscored).
        mask: (B, L) bool, True where the position is scored (never on padding).
        meta: name -> (B, L) long, per-position metadata of scored positions (-1 elsewhere).
        key_mask: (B, L) bool, True = real token, for rows of different lengths padded on
            the right to the longest; None = every position is real (fixed-length rows).

    :meth:`packed` gives the same batch as (T,) tensors, the real tokens end to end.
    """

    ids: Tensor
    targets: Tensor
    mask: Tensor
    meta: dict[str, Tensor] = field(default_factory=dict)
    key_mask: Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def tokens(self) -> int:
        """The number of real tokens: True entries of ``key_mask``, or every position."""
        if self.key_mask is None:
            return int(self.ids.numel())
        return int(self.key_mask.sum())

    def slice(self, start: int, stop: int) -> Batch:
        """Examples ``start..stop-1`` (a rank's share of a global batch)."""
        return Batch(
            self.ids[start:stop],
            self.targets[start:stop],
            self.mask[start:stop],
            {k: v[start:stop] for k, v in self.meta.items()},
            None if self.key_mask is None else self.key_mask[start:stop],
        )

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.ids.to(device),
            self.targets.to(device),
            self.mask.to(device),
            {k: v.to(device) for k, v in self.meta.items()},
            None if self.key_mask is None else self.key_mask.to(device),
        )

    def packed(self) -> tuple[Batch, Tensor]:
        """The batch without padding, as :func:`relpos.pack` lays it out.

        Returns:
            ``(packed, cu_seqlens)``: a :class:`Batch` of (T,) tensors (``ids``,
            ``targets``, ``mask`` and ``meta``; ``key_mask`` None), the real tokens of every
            row end to end (T = :attr:`tokens`), and ``cu_seqlens`` (B + 1,) int32, the
            rows' boundaries (what ``model(ids, cu_seqlens=...)`` takes).
        """
        from relpos.varlen import pack

        padding = None if self.key_mask is None else ~self.key_mask
        ids, cu = pack(self.ids, padding)
        return Batch(
            ids,
            pack(self.targets, padding)[0],
            pack(self.mask, padding)[0],
            {k: pack(v, padding)[0] for k, v in self.meta.items()},
        ), cu


def _stream_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across runs and platforms)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _check_distances(distances: Sequence[int], name: str) -> tuple[int, ...]:
    values = tuple(distances)
    if not values:
        raise ValueError(f"{name}: need at least one distance, got {list(values)!r}")
    for d in values:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"{name}: distances must be ints >= 1, got {list(values)!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: distances must be distinct, got {list(values)!r}")
    return tuple(sorted(values))


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class Task(ABC):
    """A source of batches, a pure function of ``(seed, split, step, length)``."""

    #: Registry name (``--task``).
    name: str = ""
    #: Targets are next tokens, so a bidirectional model would see the answer.
    causal_only: bool = False
    #: The meta key accuracy is broken down by, if any.
    breakdown: str | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct token ids."""

    @abstractmethod
    def min_length(self) -> int:
        """The shortest sequence length the task can fill."""

    @property
    def variable_length(self) -> bool:
        """Whether the rows of a batch have different lengths (padded, with a ``key_mask``;
        :meth:`batch`'s ``batch_size * length`` is then a token budget)."""
        return False

    #: The constructor arguments :meth:`config` records, read from the attributes of the
    #: same names (tuples as lists).
    config_fields: ClassVar[tuple[str, ...]] = ()

    def config(self) -> dict[str, Any]:
        """JSON-able parameters; ``task_from_config(task.config())`` rebuilds the task."""
        values = {k: getattr(self, k) for k in self.config_fields}
        return {"name": self.name, **{k: list(v) if isinstance(v, tuple) else v
                                      for k, v in values.items()}}

    @abstractmethod
    def _example(
        self, rng: random.Random, length: int, split: str
    ) -> tuple[list[int], list[int], list[bool], dict[str, list[int]]]:
        """One example: ids, targets, mask and meta lists of ``length`` items."""

    def batch(self, *, seed: int, step: int, batch_size: int, length: int, split: str) -> Batch:
        """The batch of ``batch_size`` examples for ``(seed, split, step, length)``.

        Args:
            seed: the run's seed.
            step: the step (training) or batch index (evaluation).
            batch_size: B, the number of examples (the global batch in distributed runs).
            length: L, the sequence length.
            split: ``"train"`` or ``"eval"``.

        Returns:
            A :class:`Batch` of (B, L) tensors.

        Raises:
            ValueError: on an unknown split or a length below :meth:`min_length`.
        """
        self._check_request(batch_size=batch_size, length=length, split=split)
        rng = random.Random(_stream_seed(self.name, seed, split, step, length))
        rows = [self._example(rng, length, split) for _ in range(batch_size)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        targets = torch.tensor([r[1] for r in rows], dtype=torch.long)
        mask = torch.tensor([r[2] for r in rows], dtype=torch.bool)
        keys = rows[0][3].keys()
        meta = {k: torch.tensor([r[3][k] for r in rows], dtype=torch.long) for k in keys}
        return Batch(ids, targets, mask, meta)

    def _check_request(self, *, batch_size: int, length: int, split: str) -> None:
        """Refuse an unknown split, a batch size below 1 or a length below
        :meth:`min_length`."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        _check_int(batch_size, "batch_size", 1)
        _check_int(length, "length", 1)
        if length < self.min_length():
            raise ValueError(
                f"task {self.name!r} needs sequences of length >= {self.min_length()}, got {length}"
            )


class OffsetRecall(Task):
    """Predict the symbol exactly ``d`` positions back, ``d`` named by a probe token.

    Tokens ``0..S-1`` are symbols, drawn uniformly; token ``S + n`` is the probe for the
    n-th distance. About one position in ``probe_every`` holds a probe ``P_d`` at position
    ``p >= d``; its target is the symbol at ``p - d`` (never itself a probe). Because the
    symbols are independent, only the offset ``d`` identifies the answer.

    Args:
        distances: the dependency distances d (ints >= 1), drawn uniformly per probe.
        num_symbols: S, the symbol alphabet (chance accuracy is 1/S).
        probe_every: one probe per this many positions.
    """

    name = "recall"
    breakdown = "distance"
    config_fields = ("distances", "num_symbols", "probe_every")

    def __init__(
        self,
        distances: Sequence[int] = DEFAULT_RECALL_DISTANCES,
        *,
        num_symbols: int = 16,
        probe_every: int = 4,
    ) -> None:
        self.distances = _check_distances(distances, "recall")
        self.num_symbols = _check_int(num_symbols, "num_symbols", 2)
        self.probe_every = _check_int(probe_every, "probe_every", 2)

    @property
    def vocab_size(self) -> int:
        return self.num_symbols + len(self.distances)

    def probe_token(self, distance: int) -> int:
        """The token id of the probe asking for the symbol ``distance`` back."""
        return self.num_symbols + self.distances.index(distance)

    def min_length(self) -> int:
        return self.distances[-1] + 1

    def _example(
        self, rng: random.Random, length: int, split: str
    ) -> tuple[list[int], list[int], list[bool], dict[str, list[int]]]:
        ids = [rng.randrange(self.num_symbols) for _ in range(length)]
        targets = [0] * length
        mask = [False] * length
        dist = [-1] * length
        sources: set[int] = set()
        wanted = max(1, length // self.probe_every)
        placed = 0
        for _ in range(20 * wanted):
            if placed == wanted:
                break
            d = self.distances[rng.randrange(len(self.distances))]
            p = rng.randrange(d, length)
            # p must still hold a symbol that no probe reads; p - d must be a symbol.
            if mask[p] or p in sources or mask[p - d]:
                continue
            targets[p] = ids[p - d]
            ids[p] = self.probe_token(d)
            mask[p] = True
            dist[p] = d
            sources.add(p - d)
            placed += 1
        return ids, targets, mask, {"distance": dist}


class Agreement(Task):
    """Subject-verb number agreement across ``d`` tokens with attractors in between.

    Vocabulary: ``F`` filler words, ``N`` singular and ``N`` plural nouns, and the tokens
    ``SUBJ`` (marks the next noun as a subject), ``VERB`` (asks for the verb's number) and
    the answers ``SG``/``PL``. Each example opens with a marked subject, then clauses
    ``SUBJ noun_s ... VERB`` follow; the verb stands ``d`` tokens after its subject and must
    agree with it, the most recent marked subject. Between them lie fillers and unmarked
    nouns of random number (attractors); the earlier marked subject has a random number
    too, so a model must tell the nearest marked subject from the farther ones.

    Args:
        distances: the subject-verb distances d (ints >= 2), drawn uniformly per clause.
        num_nouns: N, nouns per number.
        num_fillers: F, filler words.
        attractor_rate: probability that a free position holds an (unmarked) noun.
    """

    name = "agree"
    breakdown = "distance"
    config_fields = ("distances", "num_nouns", "num_fillers", "attractor_rate")

    def __init__(
        self,
        distances: Sequence[int] = DEFAULT_AGREE_DISTANCES,
        *,
        num_nouns: int = 8,
        num_fillers: int = 8,
        attractor_rate: float = 0.3,
    ) -> None:
        self.distances = _check_distances(distances, "agree")
        if self.distances[0] < 2:
            raise ValueError(f"agree: distances must be >= 2, got {list(self.distances)!r}")
        self.num_nouns = _check_int(num_nouns, "num_nouns", 1)
        self.num_fillers = _check_int(num_fillers, "num_fillers", 1)
        if not 0.0 <= attractor_rate <= 1.0:
            raise ValueError(f"attractor_rate must be in [0, 1], got {attractor_rate!r}")
        self.attractor_rate = float(attractor_rate)
        base = self.num_fillers + 2 * self.num_nouns
        self.subj_token = base
        self.verb_token = base + 1
        self.sg_token = base + 2
        self.pl_token = base + 3

    @property
    def vocab_size(self) -> int:
        return self.num_fillers + 2 * self.num_nouns + 4

    def noun_number(self, token: int) -> str | None:
        """``"sg"``/``"pl"`` for a noun token, None for anything else."""
        start = self.num_fillers
        if start <= token < start + self.num_nouns:
            return "sg"
        if start + self.num_nouns <= token < start + 2 * self.num_nouns:
            return "pl"
        return None

    def min_length(self) -> int:
        # The opening subject (2 tokens) + one clause at the largest distance.
        return 2 + 2 + self.distances[-1]

    def _noun(self, rng: random.Random) -> int:
        return self.num_fillers + rng.randrange(2 * self.num_nouns)

    def _example(
        self, rng: random.Random, length: int, split: str
    ) -> tuple[list[int], list[int], list[bool], dict[str, list[int]]]:
        rate = self.attractor_rate
        ids = [
            self._noun(rng) if rng.random() < rate else rng.randrange(self.num_fillers)
            for _ in range(length)
        ]
        targets = [0] * length
        mask = [False] * length
        dist = [-1] * length
        ids[0] = self.subj_token
        ids[1] = self._noun(rng)
        cursor = 2
        while True:
            gap = rng.randrange(4)
            d = self.distances[rng.randrange(len(self.distances))]
            subject = cursor + gap + 1
            verb = subject + d
            if verb >= length:  # the next clause does not fit
                break
            ids[subject - 1] = self.subj_token
            noun = self._noun(rng)
            ids[subject] = noun
            ids[verb] = self.verb_token
            targets[verb] = self.sg_token if self.noun_number(noun) == "sg" else self.pl_token
            mask[verb] = True
            dist[verb] = d
            cursor = verb + 1
        return ids, targets, mask, {"distance": dist}


class SortWindows(Task):
    """Windows of ``w`` symbols, a separator, then the symbols in sorted order.

    Each block is ``x_1 .. x_w SEP y_1 .. y_w`` with ``y = sorted(x)``; the sequence holds
    as many whole blocks as fit and is padded with ``PAD``. Scored positions predict the
    next sorted symbol: ``SEP`` predicts ``y_1`` and ``y_k`` predicts ``y_(k+1)``. The rule
    is the same at every length. Meta ``slot`` is the index k of the predicted symbol.

    Args:
        window: w, symbols per window.
        num_symbols: S, the symbol alphabet.
    """

    name = "sort"
    causal_only = True
    breakdown = "slot"
    config_fields = ("window", "num_symbols")

    def __init__(self, *, window: int = 4, num_symbols: int = 16) -> None:
        self.window = _check_int(window, "window", 1)
        self.num_symbols = _check_int(num_symbols, "num_symbols", 2)
        self.sep_token = self.num_symbols
        self.pad_token = self.num_symbols + 1

    @property
    def vocab_size(self) -> int:
        return self.num_symbols + 2

    def min_length(self) -> int:
        return 2 * self.window + 1

    def _example(
        self, rng: random.Random, length: int, split: str
    ) -> tuple[list[int], list[int], list[bool], dict[str, list[int]]]:
        w = self.window
        ids = [self.pad_token] * length
        targets = [0] * length
        mask = [False] * length
        slot = [-1] * length
        block = 2 * w + 1
        for start in range(0, length - block + 1, block):
            xs = [rng.randrange(self.num_symbols) for _ in range(w)]
            ys = sorted(xs)
            ids[start : start + w] = xs
            ids[start + w] = self.sep_token
            ids[start + w + 1 : start + block] = ys
            for k in range(w):
                pos = start + w + k  # SEP (k = 0) or y_k predicts y_(k+1)
                targets[pos] = ys[k]
                mask[pos] = True
                slot[pos] = k
        return ids, targets, mask, {"slot": slot}


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


#: Task names accepted by ``--task`` and :func:`build_task`.
TASKS = ("recall", "agree", "sort", "text")


def build_task(
    name: str,
    *,
    distances: Sequence[int] | None = None,
    text: str | Path | None = None,
    num_symbols: int | None = None,
    window: int | None = None,
    unit: str | None = None,
) -> Task:
    """Build a task by name (the ``--task`` choices).

    Args:
        name: one of :data:`TASKS`.
        distances: dependency distances for ``recall``/``agree`` (default: the task's).
        text: the text file of ``text``.
        num_symbols: symbol alphabet of ``recall``/``sort``.
        window: window size of ``sort``.
        unit: the example unit of ``text`` (:data:`TEXT_UNITS`; default ``"window"``;
            ``--lines`` is ``"line"``).

    Raises:
        ValueError: on an unknown name or a missing/unexpected option.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}")
    if name == "text":
        if text is None:
            raise ValueError("task 'text' needs a text file (--text FILE)")
        return TextLM(text) if unit is None else TextLM(text, unit=unit)
    if text is not None:
        raise ValueError(f"--text FILE is for task 'text', not {name!r}")
    if unit is not None:
        raise ValueError(f"unit {unit!r} (--lines) is for task 'text' (--text FILE), not "
                         f"{name!r}")
    if name == "recall":
        kw: dict[str, Any] = {} if num_symbols is None else {"num_symbols": num_symbols}
        return OffsetRecall(distances or DEFAULT_RECALL_DISTANCES, **kw)
    if name == "agree":
        return Agreement(distances or DEFAULT_AGREE_DISTANCES)
    kw = {} if num_symbols is None else {"num_symbols": num_symbols}
    if window is not None:
        kw["window"] = window
    return SortWindows(**kw)


def task_from_config(config: dict[str, Any]) -> Task:
    """Rebuild a task from :meth:`Task.config`.

    Raises:
        ValueError: if the config names an unknown task, or (``text``) the file's
            characters changed since the config was written.
    """
    params = dict(config)
    name = params.pop("name", None)
    if name == "recall":
        return OffsetRecall(**params)
    if name == "agree":
        return Agreement(**params)
    if name == "sort":
        return SortWindows(**params)
    if name == "text":
        chars = params.pop("chars", None)
        task = TextLM(**params)
        if chars is not None and "".join(task.chars) != chars:
            raise ValueError(
                f"text file {params.get('path')!r} has changed: its characters differ from "
                "those the checkpoint was trained on"
            )
        return task
    raise ValueError(f"unknown task {name!r} in config; allowed: {', '.join(TASKS)}")
