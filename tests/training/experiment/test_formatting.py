"""How the report writes intervals and seeds (relpos.training.experiment.formatting)."""

from __future__ import annotations

import math
from dataclasses import replace

from relpos.training.experiment import ExperimentConfig
from relpos.training.experiment.formatting import bits, kstr, pct, pct_short, pp, seed_text
from relpos.training.experiment.stats import Interval


def test_seed_text_names_the_seeds_of_each_task():
    cfg = replace(ExperimentConfig(), seeds=(0, 1, 2, 3), code_seeds=(0, 5))
    assert seed_text(cfg.to_dict()) == "4 seeds (0-3) for recall, agree and 2 (0, 5) for pysrc"
    assert seed_text(ExperimentConfig().to_dict()) == "3 seed(s) (0-2)"
    assert seed_text(replace(ExperimentConfig(), seeds=(0, 2)).to_dict()) == "2 seed(s) (0, 2)"
    long = ExperimentConfig.long().to_dict()
    assert seed_text(long) == (
        "20 seed(s) (0-19) (K=128 and unclipped of pysrc: 41 more seeds (20-60); a "
        "comparison pairs the seeds both its models have)")


def test_intervals_as_text():
    iv = Interval(0.5, 0.25, 0.75, 3)
    assert pct(iv) == "50.0% [25.0, 75.0]" and pct_short(iv) == "50.0 ±25.0"
    assert pp(iv) == "+50.0 pp [+25.0, +75.0]"
    assert bits(iv) == "0.500 [0.250, 0.750]" and bits(iv, True) == "+0.500 [+0.250, +0.750]"
    none = Interval(math.nan, math.nan, math.nan, 0)
    assert (pct(none), pct_short(none), pp(none), bits(none)) == ("n/a", "", "n/a", "n/a")
    assert (kstr(16, "none"), kstr(None, "none")) == ("K=16", "none")
