"""``relpos export-onnx``: export a saved relpos module to ONNX with dynamic batch and length.

``relpos export-onnx layer.pt -o layer.onnx --check`` reads a module saved with
:func:`relpos.export.save_module` (or a ``relpos train`` checkpoint: the ``--out`` directory of
``relpos train`` or its ``checkpoints/``), exports it with ``torch.onnx.export(..., dynamo=True)``
and, with ``--check``, runs the file in onnxruntime at three lengths and compares it to
PyTorch. Needs the ``onnx`` extra. The output is checked before the (slow) export.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

from relpos.cli import CLIError, _args, _one_line
from relpos.cli._args import checkpoint_dir

#: The oldest ONNX opset the exporter writes (torch.onnx's dynamo exporter starts at 18;
#: asked for an older one it silently writes 18 or fails to convert).
MIN_OPSET = 18


SUMMARY = "export a saved module to ONNX (dynamic batch and sequence length)"
DESCRIPTION = """\
Export a module saved with relpos.export.save_module (or a relpos train run: its --out
directory or the checkpoints/ in it) to ONNX. The graph has dynamic batch and length axes
and computes the relative positions at run time, so it serves every sequence length. Needs
the 'onnx' extra: pip install 'relpos[onnx]'.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos export-onnx``."""
    p.add_argument("model", metavar="MODEL",
                   help="saved module file, relpos train --out directory or checkpoint directory")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="ONNX file to write (default: MODEL with the suffix .onnx)")
    p.add_argument("--causal", action="store_true", help="export causal self-attention")
    p.add_argument("--key-mask", action="store_true",
                   help="add a key_mask input: (batch, length) bool, True = real token")
    p.add_argument("--example-length", type=_args.positive_int, default=7, metavar="L",
                   help="sequence length of the tracing example (default 7; the graph serves "
                        "all lengths)")
    p.add_argument("--opset", type=_args.int_in(MIN_OPSET), metavar="N",
                   help=f"ONNX opset version, from {MIN_OPSET} to the newest the installed "
                        "onnx knows (default: the exporter's)")
    p.add_argument("--no-optimize", action="store_true",
                   help="skip the exporter's graph optimizer")
    p.add_argument("--check", action="store_true",
                   help="run the file in onnxruntime at three lengths and compare it to PyTorch")
    p.add_argument("--atol", type=_args.positive_float, default=1e-4, metavar="TOL",
                   help="largest difference --check accepts (default 1e-4)")


def run(args: argparse.Namespace) -> int:
    if args.example_length < 2:
        raise CLIError(f"--example-length must be >= 2, got {args.example_length}")
    # The paths first: they take no time, the imports and the export do.
    given = Path(args.model)
    if not given.exists():
        raise CLIError(f"no such file or directory: {str(given)!r}")
    source = checkpoint_dir(given) if given.is_dir() else given
    if args.output is None and not given.name:
        raise CLIError(f"name the output file with -o (MODEL is {str(given)!r})")
    output = _args.check_output_file(args.output or given.with_suffix(".onnx"))
    if output.resolve() == source.resolve():
        raise CLIError(f"the output {str(output)!r} would overwrite the model")

    from relpos.export import check_onnx, export_onnx, load_module, require_onnx

    try:
        require_onnx()
    except ImportError as err:
        raise CLIError(str(err)) from None
    if args.opset is not None:
        import onnx

        newest = int(onnx.defs.onnx_opset_version())
        if args.opset > newest:
            raise CLIError(
                f"--opset {args.opset} is newer than the installed onnx {onnx.__version__} "
                f"knows; allowed: {MIN_OPSET}..{newest}"
            )
    try:
        module = load_module(source)
    except RuntimeError as err:  # load_state_dict: missing, unexpected or misshapen weights
        raise CLIError(f"cannot load {str(given)!r}: {_one_line(err, 300)}") from None
    # The exporter's progress lines and internal deprecation notices are not for CLI users.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            export_onnx(
                module, output, is_causal=args.causal, key_mask=args.key_mask,
                example_length=args.example_length, opset_version=args.opset,
                optimize=not args.no_optimize,
            )
        except RuntimeError as err:
            raise CLIError(str(err).splitlines()[0]) from None
    print(f"wrote {output}")
    if args.check:
        n = args.example_length
        lengths = (1, n + 3, 2 * n + 1)
        try:
            worst = check_onnx(
                output, module, lengths, is_causal=args.causal, key_mask=args.key_mask
            )
        except Exception as err:  # onnxruntime's errors derive from Exception only
            raise CLIError(
                f"--check: onnxruntime could not run {str(output)!r}: {_one_line(err, 300)}"
            ) from None
        status = "ok" if worst <= args.atol else "FAILED"
        print(
            f"check: onnxruntime vs PyTorch at lengths {', '.join(map(str, lengths))}: "
            f"max |diff| = {worst:.3g} (atol {args.atol:g}) {status}"
        )
        if worst > args.atol:
            return 1
    return 0
