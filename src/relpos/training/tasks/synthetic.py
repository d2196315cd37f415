"""The synthetic tasks: :class:`OffsetRecall` (``recall``), :class:`Agreement` (``agree``) and
:class:`SortWindows` (``sort``); see :mod:`relpos.training.tasks`."""


from __future__ import annotations

import random
from collections.abc import Sequence

from relpos.training.tasks.base import Task, _check_distances, _check_int

__all__ = ["DEFAULT_AGREE_DISTANCES", "DEFAULT_RECALL_DISTANCES", "Agreement", "OffsetRecall",
           "SortWindows"]

#: Default dependency distances of the synthetic tasks (up to 32).
DEFAULT_RECALL_DISTANCES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_AGREE_DISTANCES = (2, 4, 6, 8, 12, 16, 24, 32)


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
