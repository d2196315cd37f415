"""The README's commands are the ones CI runs, its convention matrices are relpos's, and only
two of its Python blocks are not run (tests/test_doc_blocks.py runs its blocks)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_only_the_hugging_face_and_eole_blocks_are_not_run():
    # Every other Python block runs (tests/test_doc_blocks.py runs the README's blocks).
    from test_doc_blocks import parse

    blocks, problems = parse("README.md")
    assert not problems, problems
    python = [b for b in blocks if b.lang == "python"]
    skipped = [b for b in python if not b.runs]
    assert len(python) >= 6 and len(skipped) == 2
    assert skipped[0].directive("network") is not None
    assert "from relpos.integrations.transformers import patch" in skipped[0].text
    assert "patch(model)" in skipped[0].text
    assert "pip install 'relpos[transformers]'" in README
    assert skipped[1].directive("skip") is not None
    assert "relpos.integrations.eole.patch_on_build()" in skipped[1].text  # it patches eole
    assert "pip install 'relpos[eole]'" in README


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = [line for line in ci.splitlines() if "pytest" in line]
    assert len(command) == 1
    assert f"```bash\n{command[0]}\n```" in README


def test_convention_matrices_match_relative_position_index():
    import torch

    import relpos

    # The K = 2 matrix and, beside it, the window (2, 1): one or two "query i" rows a line.
    lines = [line for line in README.splitlines() if re.match(r"query \d+\s", line)]
    rows = [re.findall(r"query \d+\s+((?:[+-]\d+ *)+)", line) for line in lines]
    assert len(rows) == 6 and all(len(r) == 2 for r in rows), lines
    symmetric, window = (torch.tensor([[int(x) for x in r[side].split()] for r in rows])
                         for side in (0, 1))
    torch.testing.assert_close(symmetric, relpos.relative_position_index(6, 6, 2) - 2)
    torch.testing.assert_close(window, relpos.relative_position_index(6, 6, (2, 1)) - 2)
    assert "K = 2: [-2, +2], 5 rows" in README and "(2, 1): [-2, +1], 4 rows" in README


# --- Stated times: each from its measurement in relpos._timings -------------------------

DEVELOPERS = (ROOT / "DEVELOPERS.md").read_text()
DEPLOYMENT = (ROOT / "docs" / "deployment.md").read_text()
#: Times stated beside the measured ones, not measured here: the benchmark harness's own
#: estimate of a run, and the long study's extrapolation of when pysrc would plateau.
NOT_FROM_THE_SOURCE = ("about 15 minutes on 2 cores", "about 55 hours of this machine")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _min_s(seconds: float) -> str:
    """``12 min 42 s`` (``38 s`` under a minute)."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _stated_times() -> dict[str, list[str]]:
    """Every time the README and docs state, as the one source (``relpos._timings``) writes
    it, by document."""
    from relpos._timings import (
        ALL_VARIANTS_SECONDS,
        EXPERIMENT,
        FIRST_COMPILE_SECONDS,
        TEST_SUITE_SECONDS,
        VARIANT_SECONDS,
        duration_text,
        range_text,
    )
    from relpos.training.experiment import ExperimentConfig
    from relpos.training.experiment.calibrate import reference_seconds

    compile_ = duration_text(FIRST_COMPILE_SECONDS)
    suite = duration_text(max(TEST_SUITE_SECONDS))
    fresh = duration_text(reference_seconds(ExperimentConfig()) + FIRST_COMPILE_SECONDS)
    default, quick, full, long = (EXPERIMENT[p] for p in ("default", "quick", "full", "long"))
    return {
        "README.md": [
            # the main job on a fresh machine; the tests; the native kernels' first compile
            f"{fresh} on 2 CPU cores, of which {compile_} compile the native kernels",
            f"Run the tests ({suite} on 2 cores, the native kernels' first compile included",
            f"once per machine, {compile_} on 2 cores",
            # the measurements themselves, and the studies' headings
            f"the default {_min_s(default.seconds)} wall with `--jobs {default.jobs}`",
            f"{_min_s(default.compile)} of it the native kernels' first compile",
            f"`--quick` {_min_s(quick.seconds)} and `--full` {_min_s(full.seconds)} with "
            f"`--jobs {quick.jobs}`",
            f"`--long` {round(long.seconds / 60)} min with {long.jobs} jobs",
            f"(`relpos experiment --long`, 20 seeds, {round(long.seconds / 60)} min on",
            f"(`relpos experiment --full`, 3 seeds, {round(full.seconds / 60)} min with "
            f"`--jobs {full.jobs}`",
        ],
        "DEVELOPERS.md": [f"the whole suite, {suite} on 2 cores"],
        "docs/deployment.md": [
            f"{range_text(*VARIANT_SECONDS)} a variant on 2 cores",
            f"(all five: {duration_text(ALL_VARIANTS_SECONDS)} on 2 cores)",
        ],
    }


def test_every_stated_time_is_its_measurement():
    """The README, DEVELOPERS.md and the deployment page state each time as its measurement
    in ``relpos._timings`` says it (tests/training/experiment/test_times.py does the same
    for each ``relpos experiment`` preset), and no other time in minutes or hours: a new
    measurement there fails here until every text that states it follows."""
    texts = {"README.md": README, "DEVELOPERS.md": DEVELOPERS,
             "docs/deployment.md": DEPLOYMENT}
    stated = _stated_times()
    for name, phrases in stated.items():
        flat = _flat(texts[name])
        for phrase in phrases:
            assert phrase in flat, f"{name} does not state {phrase!r}"
    # Any other duration in minutes or hours is one of these phrases (or said not measured).
    from relpos.cli.experiment import PRESET_TIMES

    known = [*(p for ps in stated.values() for p in ps), *PRESET_TIMES.values(),
             *NOT_FROM_THE_SOURCE]
    duration = re.compile(r"\b\d[\d.]*(?:-[\d.]+)? (?:minutes?|min|hours?)\b")
    for name, text in texts.items():
        flat = _flat(text)
        for found in duration.finditer(flat):
            around = flat[max(0, found.start() - 120):found.end() + 120]
            assert any(found.group() in k and k in around for k in known), (
                f"{name} states {found.group()!r} ({around!r}), which relpos._timings does "
                "not hold")


def test_the_readme_names_the_measurements_machines():
    from relpos._timings import EXPERIMENT, REFERENCE_MACHINE

    assert "2-core AMD EPYC (Zen 4) VM" in REFERENCE_MACHINE
    assert EXPERIMENT["default"].machine == REFERENCE_MACHINE
    assert "quiet 2-core AMD EPYC (Zen 4) VM" in _flat(README)
    assert "Intel Xeon" in EXPERIMENT["full"].machine and "nice -n 19" in _flat(README)


def test_the_build_message_states_the_first_compile():
    from relpos._timings import FIRST_COMPILE_SECONDS
    from relpos.ops.native import compiling

    assert compiling.BUILD_SECONDS == FIRST_COMPILE_SECONDS


def test_relpos_kernels_help_states_the_measured_builds():
    import argparse

    from relpos._timings import FIRST_COMPILE_SECONDS, VARIANT_SECONDS, duration_text, range_text
    from relpos.cli import kernels

    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    helps = {a.dest: _flat(a.help or "") for a in parser._actions}
    assert duration_text(FIRST_COMPILE_SECONDS) in helps["build"]
    assert range_text(*VARIANT_SECONDS) in helps["into"]


# --- The main job installs only what it needs -------------------------------------------

#: What a fresh virtual environment holds besides the packages pip installs into it.
_VENV = ("pip", "setuptools")


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (``Jinja2>=3`` -> ``jinja2``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _closure(extras: set[str]) -> set[str]:
    """The installed distributions ``relpos[extras]`` pulls in, transitively (requirements
    under a platform marker count; those of an extra not asked for do not)."""
    from importlib import metadata

    wanted, todo = set(), ["relpos", *_VENV]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        for requirement in metadata.requires(name) or []:
            marker = requirement.partition(";")[2]
            asked = re.findall(r"""extra\s*==\s*["']([^"']+)["']""", marker)
            if asked and not (name == "relpos" and set(asked) & extras):
                continue
            todo.append(_name(requirement))
    return wanted - {"relpos"}


def _view(distributions: set[str], where: Path) -> Path:
    """A directory of links to the files of ``distributions`` alone (their top-level packages,
    modules and metadata): the site-packages of an environment holding nothing else."""
    from importlib import metadata

    where.mkdir()
    for name in sorted(distributions):
        dist = metadata.distribution(name)
        assert dist.files, f"{name} lists no files"
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            link = where / top
            if not link.exists() and not top.endswith(".pth"):
                link.symlink_to(Path(str(dist.locate_file(top))).resolve())
    return where


def test_the_main_job_needs_only_its_extras(tmp_path):
    """The README's main-job command installs ``.[train,plot]``: the study runs (at tiny
    sizes: both kinds of task, its progress bar, figures and report) where only those
    distributions are importable, as in a fresh environment made by that command."""
    import subprocess
    import sys

    setup = README.split("## Set up a fresh machine", 1)[1]
    line = next(x for x in setup.splitlines() if x.endswith("&& relpos experiment"))
    extras = set(re.search(r'pip install -q -e "\.\[([a-z,]+)\]"', line).group(1).split(","))
    assert extras == {"train", "plot"}, line
    view = _view(_closure(extras), tmp_path / "site-packages")
    assert not (view / "pytest").exists() and not (view / "triton").exists()
    corpus = tmp_path / "Lib"
    corpus.mkdir()
    for i in range(30):
        body = "".join(f"def f{i}_{j}(a, b=[1, 2]):\n    return {{'k': (a + b[0]) * {j}}}\n\n"
                       for j in range(12))
        (corpus / f"mod{i:02d}.py").write_text(body)
    argv = ["experiment", "--quick", "--tasks", "recall,pysrc", "--seeds", "0", "--ks", "2",
            "--code-ks", "2", "--steps", "2", "--code-steps", "2", "--jobs", "1",
            "--corpus-root", str(corpus), "--out", str(tmp_path / "out")]
    code = (f"import sys; sys.path[:0] = [{str(view)!r}, {str(ROOT / 'src')!r}]; "
            f"from relpos.cli import main; sys.exit(main({argv!r}))")
    # -S: no site-packages but the view (nor the editable install's finder).
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "report.md").is_file()
    assert list((tmp_path / "out").glob("*.png"))


def test_the_test_command_says_what_it_is_doing_before_its_first_result():
    """The suite's controller says how long the suite takes and what it is doing while its
    workers start and collect, before the first result (tests/conftest.py)."""
    import os
    import subprocess
    import sys

    from relpos._timings import TEST_SUITE_SECONDS, duration_text

    # A session of its own, not a worker of this one (under pytest-xdist).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider",
         "tests/test_positions.py::test_bad_clip_relative_position"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [x for x in done.stdout.splitlines() if x.strip()]
    assert lines[0] == (f"relpos tests: the whole suite takes "
                        f"{duration_text(max(TEST_SUITE_SECONDS))} on 2 cores; starting 1 "
                        "worker, each importing torch and collecting the tests before the "
                        "first result"), lines[:3]
    said = next(i for i, x in enumerate(lines) if re.match(
        r"relpos tests: collected \d+ tests in \d+ s; running$", x))
    first_result = next(i for i, x in enumerate(lines) if x.startswith("."))
    assert said < first_result, lines
