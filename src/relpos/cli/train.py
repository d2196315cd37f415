"""``relpos train``: train a small relative-position transformer on a built-in task or text.

Examples::

    relpos train --task recall -k 8 --layers 1 --steps 300 --out runs/recall-k8
    relpos train --task recall -k 8 --layers 1 --steps 300 --out runs/recall-k8 --resume
    relpos train --text notes.txt --length 128 --out runs/text
    relpos train --task agree --nproc 2 --out runs/agree-ddp      # 2 processes (torchrun)
    torchrun --nproc_per_node=2 -m relpos train --task agree --out runs/agree-ddp
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from relpos._deprecated import module_getattr, moved
from relpos.cli import CLIError, _args
from relpos.cli._args import non_negative_int, positive_int

POSITIONS = ("relative", "learned", "sinusoidal", "none")


# Options a --nproc launch does not hand on to the processes it starts (``command`` and
# ``func`` are the subcommand's own entries in the namespace).
_NOT_RELAUNCHED = ("command", "func", "nproc")
# Options that set the TrainConfig field of the same name.
_TRAIN_OPTIONS = (
    "steps", "batch_size", "length", "lr", "warmup", "weight_decay", "seed", "eval_every",
    "checkpoint_every",
)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The ``model`` options of ``relpos train`` (read by :func:`build_model_config`)."""
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    g.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    g.add_argument("--d-model", type=positive_int, default=64, help="model width (default 64)")
    g.add_argument("--ff", type=positive_int, help="MLP width (default 4*d-model)")
    _args.add_max_distance(g, 16, "clip distance K of the relative positions (default 16)")
    g.add_argument("--no-rel-keys", action="store_true", help="drop the relative key term")
    g.add_argument("--no-rel-values", action="store_true", help="drop the relative value term")
    g.add_argument("--per-head", action="store_true",
                   help="one relative table per head (default: shared)")
    g.add_argument("--positions", choices=POSITIONS, default="relative",
                   help="relative (default) or an absolute baseline without relative terms")
    g.add_argument("--bidirectional", action="store_true", help="no causal mask (encoder)")
    g.add_argument("--dropout", type=_args.float_in(0.0, 1.0), default=0.0,
                   help="dropout rate (default 0)")


def add_parser(subparsers: Any) -> None:
    """Register ``relpos train``."""
    p = _args.subcommand(
        subparsers, "train", run, "train a small relative-position transformer",
        "Train a small transformer with clipped relative positions (or an absolute baseline) "
        "on a built-in synthetic task or a text file, with AdamW, warmup and cosine decay, "
        "periodic evaluation and crash-safe checkpoints.",
    )
    g = p.add_argument_group("data")
    g.add_argument("--task", metavar="NAME",
                   help="recall (default), agree, sort or text (implied by --text)")
    g.add_argument("--text", metavar="FILE", help="character-level LM on FILE")
    g.add_argument("--distances", type=_args.int_list(1), metavar="D,D,...",
                   help="dependency distances of recall/agree (default: the task's, up to 32)")
    g.add_argument("--length", type=positive_int, default=64, help="training length (default 64)")
    g.add_argument("--eval-lengths", type=_args.int_list(1), metavar="N,N,...",
                   help="lengths evaluated at the end (default: the training length)")
    add_model_arguments(p)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=positive_int, default=300, help="steps (default 300)")
    g.add_argument("--batch-size", type=positive_int, default=32,
                   help="global batch size (default 32)")
    g.add_argument("--lr", type=_args.positive_float, default=3e-3,
                   help="peak learning rate (3e-3)")
    g.add_argument("--warmup", type=non_negative_int, default=20, help="warmup steps (20)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (0.01)")
    g.add_argument("--seed", type=non_negative_int, default=0, help="seed (default 0)")
    g = p.add_argument_group("run")
    g.add_argument("--out", default="runs/train", metavar="DIR", help="output directory")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    g.add_argument("--eval-every", type=non_negative_int, default=100,
                   help="eval period (0 = end only)")
    g.add_argument("--checkpoint-every", type=non_negative_int, default=100,
                   help="checkpoint period (0 = end only)")
    _args.add_threads(g, "torch CPU threads per process (default 1; fixed for reproducible "
                         "numbers)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--nproc", type=positive_int, metavar="N",
                   help="train data-parallel in N processes (launches torchrun on 127.0.0.1)")
    _args.add_no_progress(g)


def build_model_config(args: argparse.Namespace, vocab_size: int, max_length: int) -> Any:
    from relpos.models import ModelConfig

    relative = args.positions == "relative"
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=args.heads,
        dim_feedforward=args.ff,
        max_distance=args.max_distance if relative else 0,
        relative_keys=relative and not args.no_rel_keys,
        relative_values=relative and not args.no_rel_values,
        share_heads=not args.per_head,
        positions=args.positions,
        max_length=max_length,
        dropout=args.dropout,
        causal=not args.bidirectional,
    )


def relaunch_argv(args: argparse.Namespace) -> list[str]:
    """The ``relpos train`` arguments that reproduce ``args`` in the processes a ``--nproc``
    launch starts, without ``--nproc``.

    Every option of ``relpos train`` stores its value under its own name (``--batch-size``
    in ``batch_size``), so the namespace itself lists them: each one set is handed on
    (flags that are on, values that are not None), defaults included.
    """
    argv = ["train"]
    for dest, value in vars(args).items():
        if dest in _NOT_RELAUNCHED or value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    import torch

    from relpos.tasks import TASKS, build_task
    from relpos.training import TrainConfig, init_distributed, launch, train
    from relpos.training.distributed import shutdown
    from relpos.training.trainer import summarize

    name = args.task or ("text" if args.text else "recall")
    if name not in TASKS:
        raise CLIError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}")
    if args.text is not None and not Path(args.text).is_file():
        raise CLIError(f"text file {args.text!r} does not exist")
    task = build_task(name, distances=args.distances, text=args.text)
    eval_lengths = args.eval_lengths or (args.length,)

    if args.nproc is not None and "WORLD_SIZE" not in os.environ:
        if args.batch_size % args.nproc:
            raise CLIError(
                f"--batch-size {args.batch_size} must be divisible by --nproc {args.nproc}"
            )
        status = launch(args.nproc, relaunch_argv(args))
        if status:
            raise CLIError(f"the {args.nproc}-process run failed with exit status {status}")
        return 0

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or 1)
    max_length = max(args.length, *eval_lengths)
    model_config = build_model_config(args, task.vocab_size, max_length)
    config = TrainConfig(
        **{name: getattr(args, name) for name in _TRAIN_OPTIONS}, eval_lengths=tuple(eval_lengths)
    )
    if config.batch_size % world:
        raise CLIError(
            f"--batch-size {config.batch_size} must be divisible by the {world} processes"
        )
    ctx = init_distributed(args.device)
    try:
        _, metrics = train(
            model_config,
            task,
            config,
            out_dir=args.out,
            resume=args.resume,
            progress=not args.no_progress,
            ctx=ctx,
        )
    finally:
        shutdown(ctx)
    if ctx.is_main:
        for line in summarize(metrics):
            print(line)
        print(f"metrics: {Path(args.out) / 'metrics.json'}")
    return 0


# Argument types that lived here before relpos.cli._args.
__getattr__ = module_getattr(__name__, {
    "int_list": ("relpos.cli._args.int_list(1)", lambda: _args.int_list(1)),
    "positive_float": moved("relpos.cli._args.positive_float"),
})
