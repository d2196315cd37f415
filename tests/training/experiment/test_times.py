"""How long a sweep takes is stated from one source, ``calibrate.time_claim``: ``relpos
experiment --help`` and the README say what it says for each preset, and the report says it
for its own sweep."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from relpos.cli import experiment as cli
from relpos.training.experiment import ExperimentConfig, make_report, plan
from relpos.training.experiment.calibrate import (
    REFERENCE_OVERHEAD,
    REFERENCE_UNIT,
    cost,
    duration_text,
    reference_seconds,
    sweep_seconds,
    time_claim,
)

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()

PRESETS = {
    "default": ExperimentConfig,
    "quick": ExperimentConfig.quick,
    "full": ExperimentConfig.full,
    "long": ExperimentConfig.long,
}
FLAGS = {"default": "", "quick": " --quick", "full": " --full", "long": " --long"}
# A stated time: "about 6 minutes", "under 2 min", "6.5 hours", "40 min".
TIME = re.compile(r"\b(about|under)\b[^#]*?\b(minutes?|min|hours?)\b|\b\d+(\.\d+)? ?(min|hours?)\b")


@pytest.mark.parametrize("preset", PRESETS)
def test_help_states_each_presets_estimate(preset):
    claim = time_claim(PRESETS[preset]())
    assert cli.PRESET_TIMES[preset] == claim
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    helps = {a.dest: a.help or "" for a in parser._actions}
    said = cli.DESCRIPTION if preset == "default" else helps[preset]
    assert f"({claim}" in " ".join(said.split()) or f"takes {claim}" in " ".join(said.split())


@pytest.mark.parametrize("preset", PRESETS)
def test_readme_states_each_presets_estimate(preset):
    """Every README command line of the preset that states a time states the estimate (and
    its number of runs, where it gives one); the Reproduce block has every preset."""
    config = PRESETS[preset]()
    claim = time_claim(config)
    line = re.compile(rf"^relpos experiment{re.escape(FLAGS[preset])}\s+#(.*)$", re.M)
    comments = [c for c in line.findall(README) if TIME.search(c)]
    assert comments, f"the README states no time for relpos experiment{FLAGS[preset]}"
    for comment in comments:
        assert claim in comment, (comment, claim)
        runs = re.search(r"(\d+) runs", comment)
        if runs:
            assert int(runs.group(1)) == len(plan(config)), comment
    if preset == "default":
        setup = README.split("## Set up a fresh machine", 1)[1].split("```", 1)[0]
        assert claim in " ".join(setup.split())


def test_no_other_time_is_stated_for_a_preset():
    """The help text and the CLI module state no time but the presets' estimates."""
    text = " ".join((cli.DESCRIPTION, cli.__doc__ or "", *(
        a.help or "" for a in _actions())))
    for claim in cli.PRESET_TIMES.values():
        text = text.replace(claim, "")
    assert not TIME.search(text), TIME.search(text)


def _actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser._actions


def test_reference_seconds_is_the_plan_at_the_reference_rate():
    config = ExperimentConfig()
    costs = [cost(s, config) for s in plan(config)]
    assert reference_seconds(config) == pytest.approx(
        REFERENCE_OVERHEAD + REFERENCE_UNIT * sum(costs))
    # Two jobs share the runs out, but none ends before its own longest run.
    assert sweep_seconds([4.0, 1.0, 1.0], 1.0, 2) == 4.0
    assert sweep_seconds([2.0, 2.0, 2.0, 2.0], 1.0, 2) == 4.0
    assert sweep_seconds([3.0], 1.0, 2) == 3.0 and sweep_seconds([], 1.0, 1) == 0.0
    long = ExperimentConfig.long()
    assert reference_seconds(long) < reference_seconds(replace(long, jobs=1))


@pytest.mark.parametrize(("seconds", "text"), [
    (10, "under a minute"), (52, "about 1 minute"), (95, "about 2 minutes"),
    (350, "about 6 minutes"), (1104, "about 20 minutes"), (3300, "about 55 minutes"),
    (3500, "about 1 hour"), (23030, "about 6.5 hours"), (math.nan, "under a minute"),
])
def test_duration_text_rounds(seconds, text):
    assert duration_text(seconds) == text


def test_the_report_states_its_sweeps_estimate(synthetic):
    results = synthetic({0: (0.5, 0.1), 8: (0.9, 0.3), 64: (0.95, 0.9)})
    config = ExperimentConfig.from_dict(results["config"])
    report = make_report(results)
    reproduce = report.split("## Reproduce", 1)[1]
    assert f"takes {time_claim(config)}" in " ".join(reproduce.split())
