"""The command line starts without torch, and its shared argument types behave."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from relpos.cli import _args, build_parser

CLI = Path(__file__).resolve().parents[2] / "src" / "relpos" / "cli"
HEAVY = ("torch", "numpy", "matplotlib")


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["table"], *(["table", "--format", f] for f in ("csv", "json", "markdown")),
     ["heatmap", "--help"], ["bench", "--help"], ["train", "--help"]],
)
def test_cli_runs_without_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from relpos.cli import main\n"
        "try:\n"
        f"    status = main({argv!r})\n"
        "except SystemExit as done:  # --help exits through argparse\n"
        "    status = done.code\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "assert not heavy, heavy\n"
        "assert status in (0, None), status\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout


def test_subcommands_import_no_heavy_module_or_sibling() -> None:
    """Module level of relpos.cli.*: no torch/numpy/matplotlib, no validators from a sibling
    subcommand (shared ones live in relpos.cli._args; private helpers, ``_name``, are no
    subcommand)."""
    bad = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for name in names:
                parts = name.split(".")
                if parts[0] in HEAVY:
                    bad.append(f"{path.name} imports {name}")
                if (parts[:2] == ["relpos", "cli"] and len(parts) > 2
                        and not parts[2].startswith("_")
                        and (CLI / f"{parts[2]}.py").is_file()):
                    bad.append(f"{path.name} imports the subcommand module {name}")
    assert not bad, bad


def test_int_list_and_float_types() -> None:
    assert _args.int_list(0)("0, 4,16") == (0, 4, 16)
    assert _args.int_list(1)("8 16") == (8, 16)
    for bad in ("", "1,x", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            _args.int_list(1)(bad)
    assert _args.positive_float("1e-4") == 1e-4
    for bad in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _args.positive_float(bad)
    assert _args.float_in(0.0, 1.0)("0") == 0.0
    for bad in ("1", "-0.1", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            _args.float_in(0.0, 1.0)(bad)
    assert _args.name_list(("a", "b"), "x")("b, a") == ("b", "a")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown x"):
        _args.name_list(("a", "b"), "x")("a,c")


def test_train_relaunch_argv_reproduces_the_options() -> None:
    from relpos.cli.train import relaunch_argv

    parser = build_parser()
    args = parser.parse_args([
        "train", "--task", "agree", "--distances", "2,4", "--lr", "0.0007", "-k", "3",
        "--per-head", "--no-rel-values", "--eval-lengths", "16,32", "--nproc", "2",
        "--dropout", "0.1", "--threads", "1", "--no-progress", "--lines", "--pad",
    ])
    argv = relaunch_argv(args)
    assert "--nproc" not in argv
    again = parser.parse_args(argv)
    assert vars(again) == {**vars(args), "nproc": None}


def test_old_names_warn() -> None:
    import relpos.cli.bench as bench
    import relpos.cli.table as table
    import relpos.cli.train as train

    with pytest.warns(DeprecationWarning, match=r"relpos\.cli\._args\.positive_int"):
        assert table.positive_int("3") == 3
    with pytest.warns(DeprecationWarning, match="int_list"):
        assert train.int_list("1,2") == (1, 2)
    with pytest.warns(DeprecationWarning, match=r"relpos\.bench\.attention\.Config"):
        assert bench.Config.__module__ == "relpos.bench.attention"
    with pytest.raises(AttributeError):
        table.no_such_name  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callable(_args.positive_int)
