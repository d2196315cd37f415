"""``relpos export-ct2``: export a relpos language model to a CTranslate2 model directory.

``relpos export-ct2 runs/train -o lm-ct2 --check`` reads a model saved with
:func:`relpos.export.save_module` or a ``relpos train`` checkpoint (the ``--out`` directory of
``relpos train`` or its ``checkpoints/``), writes it with
:func:`relpos.export.ctranslate2.to_ctranslate2` (the characters of a ``--text`` run
become the vocabulary; otherwise token ``i`` is ``"i"``) and, with ``--check``, compares
CTranslate2 with relpos: log-probs over the vocabulary at every prompt position and greedy
tokens, for one prompt and a ragged batch. Needs the ``ct2`` extra. The paths are checked
before torch loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relpos.cli import CLIError, _args, _one_line

#: ``--quantization`` choices (CTranslate2 weight types); none = float32 weights.
QUANTIZATIONS = ("int8", "int16", "float16", "bfloat16")


SUMMARY = "export a language model to CTranslate2 (relative positions in its decoder)"
DESCRIPTION = """\
Export a RelativeTransformerLM saved with relpos.export.save_module (or a relpos train run:
its --out directory or the checkpoints/ in it) to a CTranslate2 model directory for
ctranslate2.Generator. CTranslate2's decoder computes Shaw et al.'s clipped relative
attention itself: shared tables, a symmetric K. The characters of a --text run are the
vocabulary; otherwise token i is named "i". Generate with end_token=[] (the model has no end
token). Needs the 'ct2' extra: pip install 'relpos[ct2]'.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos export-ct2``."""
    p.add_argument("model", metavar="MODEL",
                   help="saved module file, relpos train --out directory or checkpoint directory")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="model directory to write (default: MODEL with the suffix .ct2)")
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="weight type (default: float32 weights)")
    p.add_argument("--vocabulary", metavar="FILE",
                   help="JSON file: a list of vocab_size token strings, or one string of "
                        "vocab_size characters (default: a --text run's characters, else "
                        "\"0\", \"1\", ...)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output directory (once the new one is written)")
    p.add_argument("--check", action="store_true",
                   help="compare CTranslate2 with relpos: log-probs and greedy tokens, batch 1 "
                        "and a ragged batch")
    p.add_argument("--max-new-tokens", type=_args.positive_int, default=8, metavar="N",
                   help="greedy tokens per prompt in --check (default 8)")
    p.add_argument("--atol", type=_args.positive_float, metavar="TOL",
                   help="largest log-prob difference --check accepts (default 1e-4 for float32 "
                        "weights; with --quantization the difference is reported and not "
                        "judged unless --atol is given)")


def run(args: argparse.Namespace) -> int:
    # The paths first: they take no time, the imports and the export do.
    given = Path(args.model)
    if not given.exists():
        raise CLIError(f"no such file or directory: {str(given)!r}")
    source = _args.checkpoint_dir(given) if given.is_dir() else given
    if args.output is None and not given.name:
        raise CLIError(f"name the output directory with -o (MODEL is {str(given)!r})")
    output = Path(args.output) if args.output is not None else given.with_suffix(".ct2")
    _check_output(output, source, force=args.force)
    vocabulary = _read_vocabulary(Path(args.vocabulary)) if args.vocabulary else None

    from relpos.export import load_module
    from relpos.export.ctranslate2 import (
        check_ctranslate2,
        checkpoint_vocabulary,
        require_ctranslate2,
        to_ctranslate2,
    )

    require_ctranslate2()  # a ValueError: one line, before loading the model
    try:
        module = load_module(source)
    except RuntimeError as err:  # load_state_dict: missing, unexpected or misshapen weights
        raise CLIError(f"cannot load {str(given)!r}: {_one_line(err, 300)}") from None
    if vocabulary is None and source.is_dir():
        vocabulary = checkpoint_vocabulary(source)
    try:
        to_ctranslate2(
            module, output, quantization=args.quantization, vocabulary=vocabulary,
            force=args.force,
        )
    except (RuntimeError, OSError) as err:  # CTranslate2's converter, the file system
        raise CLIError(f"cannot write {str(output)!r}: {_one_line(err, 300)}") from None
    print(f"wrote {output}")
    if not args.check:
        return 0
    try:
        result = check_ctranslate2(module, output, max_new_tokens=args.max_new_tokens)
    except RuntimeError as err:  # CTranslate2 could not load or run the directory
        raise CLIError(
            f"--check: CTranslate2 could not run {str(output)!r}: {_one_line(err, 300)}"
        ) from None
    atol = args.atol if args.atol is not None else (None if args.quantization else 1e-4)
    for case in result.cases:
        lengths = ", ".join(map(str, case.lengths))
        print(
            f"check: {case.name} (prompt lengths {lengths}): max |log-prob diff| = "
            f"{case.max_logprob_diff:.3g}, greedy tokens "
            f"{'identical' if case.greedy_match else 'DIFFER'} ({result.max_new_tokens} each)"
        )
    if atol is None:
        print(
            f"check: {args.quantization} weights: max |log-prob diff| = "
            f"{result.max_logprob_diff:.3g} (not judged; pass --atol to)"
        )
        return 0
    ok = result.ok(atol)
    print(
        f"check: CTranslate2 vs relpos: max |log-prob diff| = {result.max_logprob_diff:.3g} "
        f"(atol {atol:g}), greedy tokens {'identical' if result.greedy_match else 'DIFFER'} "
        f"{'ok' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


def _check_output(output: Path, source: Path, *, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise CLIError(f"the output {str(output)!r} is a file; allowed: a directory to write")
    resolved, src = output.resolve(), source.resolve()
    if resolved == src or resolved in src.parents:
        raise CLIError(f"the output {str(output)!r} would overwrite the model {str(source)!r}")
    if output.exists() and not force:
        raise CLIError(
            f"the output {str(output)!r} exists; allowed: a new directory, or --force to "
            "replace it"
        )
    parent = output.parent
    if not parent.is_dir():
        what = "is a file, not a directory" if parent.exists() else "does not exist"
        raise CLIError(f"output directory {str(parent)!r} {what}")
    _args.check_output_dir(parent, "-o")


def _read_vocabulary(path: Path) -> str | list[str]:
    try:
        tokens = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CLIError(f"--vocabulary: no such file: {str(path)!r}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CLIError(
            f"--vocabulary {str(path)!r} is not a JSON file: {_one_line(err, 300)}"
        ) from None
    if isinstance(tokens, str):
        return tokens
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        return tokens
    raise CLIError(
        f"--vocabulary {str(path)!r} holds a {type(tokens).__name__}; allowed: a JSON list of "
        "token strings, or one string of characters"
    )
