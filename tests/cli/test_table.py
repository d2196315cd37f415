"""``relpos table``: the worked example of the handbook section on clipped relative positions
(Shaw et al., 2018), with the table row each key reads (the columns of every format) and
``K`` spelt as everywhere else."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys

import pytest

from relpos import clip_relative_position, relative_position_index
from relpos.cli import main

# The block of the handbook section on clipped relative positions (Out[7]), its numbers
# unchanged, with the Table Row column the csv, json and markdown formats have and K as the
# rest of relpos writes it: the tests hold the fact themselves and read nothing outside the
# repository.
EXPECTED_BLOCK = """\
Query position: 5
Maximum relative distance (K): 4

Position | Raw Offset | Clipped Offset | Table Row
------------------------------------------------------
    0    |     -5     |       -4       |    0
    1    |     -4     |       -4       |    0
    2    |     -3     |       -3       |    1
    3    |     -2     |       -2       |    2
    4    |     -1     |       -1       |    3
    5    |     +0     |       +0       |    4
    6    |     +1     |       +1       |    5
    7    |     +2     |       +2       |    6
    8    |     +3     |       +3       |    7
    9    |     +4     |       +4       |    8
"""

_ROW = re.compile(r"^\s*(\d+)\s*\|\s*([+-]\d+)\s*\|\s*([+-]\d+)\s*\|\s*(\d+)\s*$")


def parse_rows(text: str) -> list[tuple[int, int, int]]:
    """(position, raw offset, clipped offset) of every table row in ``text``."""
    return [row[:3] for row in parse_full_rows(text)]


def parse_full_rows(text: str) -> list[tuple[int, int, int, int]]:
    """(position, raw offset, clipped offset, table row) of every table row in ``text``."""
    rows = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            rows.append(tuple(int(m.group(n)) for n in range(1, 5)))
    return rows  # type: ignore[return-value]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["table", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_default_table_is_the_seed_block(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert code == 0
    assert err == ""
    assert out == EXPECTED_BLOCK
    assert all(line == line.rstrip() for line in out.splitlines())


def test_defaults_equal_explicit_flags(capsys: pytest.CaptureFixture[str]) -> None:
    _, default, _ = run_cli(capsys)
    _, explicit, _ = run_cli(capsys, "--length", "10", "--query", "5", "--max-distance", "4")
    assert explicit == default
    _, explicit_text, _ = run_cli(capsys, "-k", "4", "--format", "text")
    assert explicit_text == default


def test_seed_table_equals_relative_position_index() -> None:
    block = EXPECTED_BLOCK
    query = int(re.search(r"Query position: (\d+)", block).group(1))  # type: ignore[union-attr]
    k = int(re.search(r"distance \(K\): (\d+)", block).group(1))  # type: ignore[union-attr]
    rows = parse_rows(block)
    length = len(rows)
    assert [r[0] for r in rows] == list(range(length))
    # Self-attention over the whole sequence: the query's row of the (S, S) index.
    full = relative_position_index(length, length, k)[query] - k
    # One query at an explicit position (a decoding step).
    single = relative_position_index(1, length, k, query_start=query)[0] - k
    assert full.tolist() == [r[2] for r in rows]
    assert single.tolist() == [r[2] for r in rows]
    assert [j - query for j in range(length)] == [r[1] for r in rows]
    assert [clip_relative_position(j, query, k) for j in range(length)] == [r[2] for r in rows]
    # The table row each key reads: the index itself.
    assert full.add(k).tolist() == [r[3] for r in parse_full_rows(block)]


CASES = [
    (10, 5, 4),
    (1, 0, 0),
    (7, 0, 2),
    (7, 6, 2),
    (12, 3, 0),
    (5, 2, 9),  # K larger than the sequence: nothing is clipped
    (1200, 1100, 64),  # offsets of four digits widen the columns
]


@pytest.mark.parametrize(("length", "query", "k"), CASES)
def test_text_rows_agree_with_clip(
    capsys: pytest.CaptureFixture[str], length: int, query: int, k: int
) -> None:
    code, out, _ = run_cli(
        capsys, "--length", str(length), "--query", str(query), "--max-distance", str(k)
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[:3] == [f"Query position: {query}", f"Maximum relative distance (K): {k}", ""]
    assert lines[3].split(" | ") == ["Position", "Raw Offset", "Clipped Offset", "Table Row"]
    assert set(lines[4]) == {"-"}
    rows = parse_rows(out)
    assert len(rows) == length == len(lines) - 5
    expected = [(j, j - query, clip_relative_position(j, query, k)) for j in range(length)]
    assert rows == expected
    assert [r[3] for r in parse_full_rows(out)] == [r[2] + k for r in expected]
    # The "|" separators line up in every row.
    bars = {tuple(m.start() for m in re.finditer(r"\|", line)) for line in lines[5:]}
    assert len(bars) == 1


@pytest.mark.parametrize(("length", "query", "k"), CASES)
def test_csv_json_markdown_agree_with_clip(
    capsys: pytest.CaptureFixture[str], length: int, query: int, k: int
) -> None:
    flags = ["--length", str(length), "--query", str(query), "--max-distance", str(k)]
    expected = [
        (j, j - query, clip_relative_position(j, query, k), clip_relative_position(j, query, k) + k)
        for j in range(length)
    ]

    code, out, _ = run_cli(capsys, *flags, "--format", "csv")
    assert code == 0
    records = list(csv.DictReader(io.StringIO(out)))
    assert list(records[0]) == ["position", "raw_offset", "clipped_offset", "table_row"]
    got = [tuple(int(r[c]) for c in records[0]) for r in records]
    assert got == expected

    code, out, _ = run_cli(capsys, *flags, "--format", "json")
    assert code == 0
    document = json.loads(out)
    assert (document["length"], document["query"], document["max_distance"]) == (length, query, k)
    got = [
        (r["position"], r["raw_offset"], r["clipped_offset"], r["table_row"])
        for r in document["rows"]
    ]
    assert got == expected

    code, out, _ = run_cli(capsys, *flags, "--format", "markdown")
    assert code == 0
    lines = out.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "Position",
        "Raw Offset",
        "Clipped Offset",
        "Table Row",
    ]
    assert re.fullmatch(r"\|(-+:\|){4}", lines[1])
    got = [tuple(int(c) for c in line.strip("|").split("|")) for line in lines[2:]]
    assert got == expected


def test_index_rows_match_table_rows(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_cli(capsys, "--length", "9", "--query", "2", "-k", "3", "--format", "json")
    rows = json.loads(out)["rows"]
    index = relative_position_index(1, 9, 3, query_start=2)[0]
    assert [r["table_row"] for r in rows] == index.tolist()


def test_default_query_is_the_middle(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_cli(capsys, "--length", "7")
    assert out.splitlines()[0] == "Query position: 3"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-distance", "-1"], "--max-distance"),
        (["--max-distance", "two"], "--max-distance"),
        (["--query", "10"], "--query"),
        (["--query", "-1"], "--query"),
        (["--length", "0"], "--length"),
        (["--length", "3", "--query", "3"], "0..2"),
        (["--format", "yaml"], "--format"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("relpos: error: ")
    assert needle in err
    assert "Traceback" not in err


def test_python_m_relpos_prints_the_seed_block() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "relpos", "table"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED_BLOCK


@pytest.mark.parametrize(("left", "right"), [(2, 1), (0, 3), (4, 0), (20, 1)])
def test_window_rows_agree_with_clip(capsys: pytest.CaptureFixture[str], left, right) -> None:
    code, out, err = run_cli(capsys, "--left", str(left), "--right", str(right),
                             "--format", "json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["max_distance"] == [left, right]
    for row in doc["rows"]:
        clipped = clip_relative_position(row["position"], doc["query"], (left, right))
        assert row["clipped_offset"] == clipped and row["table_row"] == clipped + left
    code, out, _ = run_cli(capsys, "--left", str(left), "--right", str(right))
    assert f"Clip window: [-{left}, +{right}]" in out
    assert [r[2] for r in parse_rows(out)] == [r["clipped_offset"] for r in doc["rows"]]


def test_one_side_defaults_to_max_distance(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_cli(capsys, "-k", "3", "--right", "1", "--format", "json")
    assert json.loads(out)["max_distance"] == [3, 1]
    _, out, _ = run_cli(capsys, "-k", "3", "--left", "3", "--right", "3")
    assert out.splitlines()[1] == "Maximum relative distance (K): 3"


@pytest.mark.parametrize("bad", [["--left", "-1"], ["--right", "x"]])
def test_bad_window_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], bad) -> None:
    code, out, err = run_cli(capsys, *bad)
    assert code == 2 and out == "" and err.startswith("relpos: error:") and err.count("\n") == 1
