"""``relpos export-onnx``: export a saved relpos module to ONNX with dynamic batch and length.

``relpos export-onnx layer.pt -o layer.onnx --check`` reads a module saved with
:func:`relpos.export.save_module` (or a ``relpos train`` checkpoint directory), exports it with
``torch.onnx.export(..., dynamo=True)`` and, with ``--check``, runs the file in onnxruntime at
three lengths and compares it to PyTorch. Needs the ``onnx`` extra.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path
from typing import Any

from relpos.cli import CLIError, _args


def add_parser(subparsers: Any) -> None:
    """Register ``relpos export-onnx``."""
    p = _args.subcommand(
        subparsers, "export-onnx", run,
        "export a saved module to ONNX (dynamic batch and sequence length)",
        "Export a module saved with relpos.export.save_module (or a relpos train checkpoint "
        "directory) to ONNX. The graph has dynamic batch and length axes and computes the "
        "relative positions at run time, so it serves every sequence length. Needs the "
        "'onnx' extra: pip install 'relpos[onnx]'.",
    )
    p.add_argument("model", metavar="MODEL", help="saved module file or checkpoint directory")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="ONNX file to write (default: MODEL with the suffix .onnx)")
    p.add_argument("--causal", action="store_true", help="export causal self-attention")
    p.add_argument("--key-mask", action="store_true",
                   help="add a key_mask input: (batch, length) bool, True = real token")
    p.add_argument("--example-length", type=_args.positive_int, default=7, metavar="L",
                   help="sequence length of the tracing example (default 7; the graph serves "
                        "all lengths)")
    p.add_argument("--opset", type=_args.positive_int, help="ONNX opset version")
    p.add_argument("--no-optimize", action="store_true",
                   help="skip the exporter's graph optimizer")
    p.add_argument("--check", action="store_true",
                   help="run the file in onnxruntime at three lengths and compare it to PyTorch")
    p.add_argument("--atol", type=_args.positive_float, default=1e-4, metavar="TOL",
                   help="largest difference --check accepts (default 1e-4)")


def run(args: argparse.Namespace) -> int:
    from relpos.export import check_onnx, export_onnx, load_module, require_onnx

    try:
        require_onnx()
    except ImportError as err:
        raise CLIError(str(err)) from None
    if args.example_length < 2:
        raise CLIError(f"--example-length must be >= 2, got {args.example_length}")
    source = Path(args.model)
    if not source.exists():
        raise CLIError(f"no such file or directory: {str(source)!r}")
    output = _args.check_output_file(args.output or source.with_suffix(".onnx"))
    if output.resolve() == source.resolve():
        raise CLIError(f"the output {str(output)!r} would overwrite the model")
    module = load_module(source)
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
        worst = check_onnx(
            output, module, lengths, is_causal=args.causal, key_mask=args.key_mask
        )
        status = "ok" if worst <= args.atol else "FAILED"
        print(
            f"check: onnxruntime vs PyTorch at lengths {', '.join(map(str, lengths))}: "
            f"max |diff| = {worst:.3g} (atol {args.atol:g}) {status}"
        )
        if worst > args.atol:
            return 1
    return 0
