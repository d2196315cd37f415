"""How long a sweep takes is stated from one source, ``calibrate.time_claim`` (a preset's
measured time in ``relpos._timings``, at one job a core): ``relpos experiment --help`` and the
README say what it says for each preset, and the report says it for its own sweep."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from relpos._timings import EXPERIMENT, FIRST_COMPILE_SECONDS
from relpos.cli import experiment as cli
from relpos.training.experiment import ExperimentConfig, make_report, plan
from relpos.training.experiment.calibrate import (
    REFERENCE_OVERHEAD,
    REFERENCE_UNIT,
    cost,
    default_jobs,
    duration_text,
    measured,
    reference_jobs,
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
    if preset == "default":  # a fresh machine: the kernels' first compile too
        setup = README.split("## Set up a fresh machine", 1)[1].split("```", 1)[0]
        fresh = duration_text(reference_seconds(config) + FIRST_COMPILE_SECONDS)
        assert (f"{fresh} on 2 CPU cores, of which {duration_text(FIRST_COMPILE_SECONDS)} "
                "compile the native kernels") in " ".join(setup.split())


def test_no_other_time_is_stated_for_a_preset():
    """The help text and the CLI module state no time but the presets' estimates."""
    text = " ".join((cli.DESCRIPTION, cli.__doc__ or "", *(
        a.help or "" for a in _actions())))
    for claim in cli.PRESET_TIMES.values():
        text = text.replace(claim, "")
    # ... and the first compile's, which the first sweep on a machine waits for
    assert f"{cli.FIRST_COMPILE} more the first time" in " ".join(text.split())
    text = text.replace(cli.FIRST_COMPILE, "")
    assert not TIME.search(text), TIME.search(text)


def _actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser._actions


def test_a_presets_time_is_its_measured_time_at_one_job_a_core():
    """The stated time of a preset is its measurement (the first compile taken out) where it
    was measured with a job per core, and scaled by the cost model's parallel share where it
    was measured with fewer."""
    for preset, make in PRESETS.items():
        config = make()
        found = EXPERIMENT[preset]
        assert measured(config) == found and measured(replace(config, jobs=7)) == found
        assert reference_seconds(config, found.jobs) == pytest.approx(found.sweep)
        if found.jobs < reference_jobs(config):
            assert reference_seconds(config) < found.sweep
    default = ExperimentConfig()
    assert reference_jobs(default) == 2 and reference_jobs(default, 1) == 1
    found = EXPERIMENT["default"]
    assert reference_seconds(default) == pytest.approx(
        found.sweep * _model(default, 2) / _model(default, found.jobs))
    # Another sweep than a preset's: the cost model alone.
    custom = replace(default, seeds=(0,), preset="custom")
    assert measured(custom) is None and measured(replace(default, steps=7)) is None
    costs = [cost(s, custom) for s in plan(custom)]
    assert reference_seconds(custom, 1) == pytest.approx(
        REFERENCE_OVERHEAD + REFERENCE_UNIT * sum(costs))


def _model(config: ExperimentConfig, jobs: int) -> float:
    costs = [cost(s, config) for s in plan(config)]
    return REFERENCE_OVERHEAD + sweep_seconds(costs, REFERENCE_UNIT, jobs)


def test_the_default_jobs_are_one_a_usable_core():
    assert default_jobs(1, 2) == 2 and default_jobs(2, 2) == 1 and default_jobs(4, 2) == 1
    assert default_jobs(1, 16) == 16 and default_jobs(3, 16) == 5


def test_relpos_experiment_runs_a_job_a_usable_core(tmp_path, monkeypatch):
    """Without --jobs the sweep runs one job per usable core (its affinity), divided by
    --threads, and keeps its preset's name; --jobs still says how many."""
    import relpos.training.experiment as experiment
    import relpos.training.experiment.calibrate as calibrate
    from relpos.cli import main

    seen = []
    monkeypatch.setattr(experiment, "run_experiment", lambda config, *a, **k: seen.append(
        config))
    monkeypatch.setattr(calibrate, "usable_cores", lambda: 6)
    for extra, jobs, preset in (([], 6, "quick"), (["--threads", "2"], 3, "custom"),
                                (["--jobs", "1"], 1, "quick")):
        assert main(["experiment", "--quick", "--out", str(tmp_path / str(len(seen))),
                     *extra]) == 0
        assert (seen[-1].jobs, seen[-1].preset) == (jobs, preset)
    # Two jobs share the runs out, but none ends before its own longest run.
    assert sweep_seconds([4.0, 1.0, 1.0], 1.0, 2) == 4.0
    assert sweep_seconds([2.0, 2.0, 2.0, 2.0], 1.0, 2) == 4.0
    assert sweep_seconds([3.0], 1.0, 2) == 3.0 and sweep_seconds([], 1.0, 1) == 0.0
    long = ExperimentConfig.long()
    assert reference_seconds(long) < reference_seconds(long, 1)


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
