"""How long things take: the measured wall times behind every time relpos states (the README,
docs/, ``--help`` texts, the native build's message, the experiment's report). Each figure
names the machine and conditions it was measured on; ``tests/test_readme.py`` checks that
every stated time is the one written here, so a new measurement is a change of one line
below, and the test names every text that must follow it.

Times depend on the machine: ``relpos experiment`` also prints an estimate timed on the
machine at hand before it starts. Nothing here imports torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = [
    "ALL_VARIANTS_SECONDS",
    "EXPERIMENT",
    "FIRST_COMPILE_SECONDS",
    "REFERENCE_CORES",
    "REFERENCE_MACHINE",
    "TEST_SUITE_SECONDS",
    "VARIANT_SECONDS",
    "Measured",
    "duration_text",
    "range_text",
]

#: The reference machine: a quiet 2-core x86-64 VM (the times below are its unless said).
REFERENCE_MACHINE = "a 2-core AMD EPYC (Zen 4) VM, torch 2.13.0+cpu, nothing else running"
#: Its CPU cores.
REFERENCE_CORES = 2


class Measured(NamedTuple):
    """A measured wall time of ``relpos experiment``: ``seconds`` with ``jobs`` parallel jobs
    of one torch thread, of which ``compile`` seconds compiled the native kernels (a first
    run on a machine), on ``machine``."""

    seconds: float
    jobs: int
    compile: float = 0.0
    machine: str = REFERENCE_MACHINE

    @property
    def sweep(self) -> float:
        """The seconds of the sweep itself, without the kernels' first compile."""
        return self.seconds - self.compile


#: The native kernels' first build on a machine (one library, ``-march=native``: the
#: message printed while it compiles, ``relpos kernels --build``).
FIRST_COMPILE_SECONDS = 40
#: One prebuilt variant (``relpos kernels --build --into DIR``): the fastest and the slowest.
VARIANT_SECONDS = (36, 43)
#: All five prebuilt variants.
ALL_VARIANTS_SECONDS = 199
#: The whole test suite (``python -m pytest -q -n 2`` on a clean clone, the first compile
#: included), the shortest and the longest of the CI runs measured.
TEST_SUITE_SECONDS = (594, 624)

_XEON_LOADED = ("a shared 2-core Intel Xeon (AVX-512, AMX) VM under nice -n 19 with other "
                "jobs running (pessimistic), torch 2.13.0+cpu")
_LONG_MACHINES = "2-core Intel Xeon and AMD EPYC VMs (AVX-512), nothing else running"

#: ``relpos experiment`` by preset. The stated time of a preset is its measured sweep,
#: scaled by the cost model to the jobs ``relpos experiment`` runs with on the reference
#: machine (one a core) where it was measured with others
#: (:func:`relpos.training.experiment.calibrate.reference_seconds`).
EXPERIMENT = {
    "default": Measured(137, jobs=2, compile=38),
    "quick": Measured(106, jobs=1, machine=_XEON_LOADED),
    "full": Measured(2342, jobs=1, machine=_XEON_LOADED),
    "long": Measured(23118, jobs=2, machine=_LONG_MACHINES),
}


def duration_text(seconds: float) -> str:
    """A duration as a stated estimate: ``about 1 minute`` (``under a minute`` below 30 s),
    whole minutes below 10 minutes, 5 minutes apart below an hour, then half hours
    (``about 6.5 hours``)."""
    if math.isnan(seconds) or seconds < 30:
        return "under a minute"
    minutes = seconds / 60
    if minutes < 1.5:
        return "about 1 minute"
    if minutes < 9.5:
        return f"about {round(minutes)} minutes"
    if minutes < 57.5:
        return f"about {5 * round(minutes / 5)} minutes"
    hours = round(2 * seconds / 3600) / 2
    return "about 1 hour" if hours == 1 else f"about {hours:g} hours"


def range_text(low: float, high: float) -> str:
    """Two measured durations as a range: of seconds to the 5 s under 90 s (``35-45 s``),
    else of minutes to the half minute (``1.5-2 minutes``); one figure when both round alike
    (``about 2 minutes``)."""
    if high < 90:
        lo_s, hi_s = (5 * round(s / 5) for s in (low, high))
        return f"about {lo_s} s" if lo_s == hi_s else f"{lo_s}-{hi_s} s"
    a, b = (round(2 * s / 60) / 2 for s in (low, high))
    if a == b:
        return f"about {a:g} minute{'' if a == 1 else 's'}"
    return f"{a:g}-{b:g} minutes"
