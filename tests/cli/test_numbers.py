"""Every number option of every subcommand at 0, negative, tiny, huge, NaN, inf and
non-numeric: refused in one line that quotes the value, or taken as a finite number in the
range torch takes (an int of at most 64 bits)."""

from __future__ import annotations

import argparse
import math

import pytest

from relpos.cli import CLIError, _args, build_parser

VALUES = ["0", "-0", "-1", "1", "0.5", "1e-320", "1e400", "99999999999999999999",
          str(2**63), str(2**64), "nan", "inf", "-inf", "abc", "", "1,1", "2,1,2"]


def _number_options() -> list[tuple[str, argparse.Action]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for name, command in sub.choices.items():
        for action in command._actions:
            kind = getattr(action.type, "__qualname__", "")
            if action.option_strings and action.type not in (None, str) and not kind.startswith(
                    "name_list"):
                found.append((name, action))
    return found


OPTIONS = _number_options()


def test_every_subcommand_has_number_options_here():
    assert {name for name, _ in OPTIONS} >= {"experiment", "train", "generate", "table",
                                              "heatmap", "bench", "export-onnx", "export-ct2"}


def _finite_numbers(value: object) -> list[float]:
    items = value if isinstance(value, tuple) else (value,)
    return [v for v in items if isinstance(v, (int, float))]


@pytest.mark.parametrize(("command", "action"), OPTIONS,
                         ids=[f"{c} {a.option_strings[-1]}" for c, a in OPTIONS])
def test_a_number_option_refuses_in_one_line_or_takes_a_finite_value(command, action):
    limit = _args.SEED_MAX if "seed" in action.dest else _args.INT_MAX
    for text in VALUES:
        try:
            value = action.type(text)
        except argparse.ArgumentTypeError as err:
            message = str(err)
            assert "\n" not in message and repr(text) in message, (text, message)
            continue
        numbers = _finite_numbers(value)
        assert numbers, (text, value)
        for v in numbers:
            assert math.isfinite(v), (text, value)
            if isinstance(v, int):
                assert -limit <= v <= limit, (text, value)
        if "," in text and action.dest in {"seeds", "ks", "code_ks", "depths"}:
            assert len(set(value)) == len(value), (text, value)  # type: ignore[arg-type]


def test_the_parser_turns_a_refusal_into_one_line():
    with pytest.raises(CLIError) as err:
        build_parser().parse_args(["train", "--steps", "nan"])
    assert str(err.value) == "argument --steps: must be an int, got 'nan'"
