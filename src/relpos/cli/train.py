"""``relpos train``: train a small relative-position transformer on a built-in task or text.

Examples::

    relpos train --task recall -k 8 --layers 1 --steps 300 --out runs/recall-k8
    relpos train --out runs/recall-k8 --resume                    # continue a stopped run
    relpos train --out runs/recall-k8 --resume --steps 600        # train longer
    relpos train --task recall -k 4 --out runs/recall-k8 --overwrite  # start over
    relpos train --text notes.txt --length 128 --out runs/text
    relpos train --text notes.txt --lines --length 256 --out runs/lines  # one line an example
    relpos train --text notes.txt --lines --pad --length 256 --out runs/lines-padded
    relpos train --task agree --nproc 2 --out runs/agree-ddp      # 2 processes (torchrun)
    torchrun --nproc_per_node=2 -m relpos train --task agree --out runs/agree-ddp
    relpos train --task recall --nproc 4 --context-parallel 2 --fsdp --out runs/cp  # dp 2 x cp 2

Resuming reads the run's settings from its checkpoint: options left out take the saved
values, options given must agree with them, except the ones that do not change what is
learned (``--eval-lengths``, ``--eval-every``, ``--checkpoint-every``, ``--threads``,
``--device``, ``--nproc``, ``--no-progress``, the scaling options ``--context-parallel``,
``--cp-mode``, ``--fsdp`` and ``--activation-checkpointing``) and ``--steps``: a larger
``--steps`` trains longer (the learning-rate schedule of the run stays: after its cosine
decay the rate holds at the floor), a smaller one (not below the checkpoint's step) stops
earlier. A run that already finished the steps asked for is left as it is (one line says
so).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from relpos._deprecated import module_getattr, moved
from relpos.cli import CLIError, _args, _interrupt, _one_line
from relpos.cli._args import non_negative_int, positive_int

POSITIONS = ("relative", "learned", "sinusoidal", "none")
#: Largest clip distance and sequence length ``relpos train`` accepts (a table of
#: ``2K + 1`` rows; ``L x L`` attention scores per head).
MAX_DISTANCE = 1 << 16
MAX_LENGTH = 1 << 16

# Options a --nproc launch does not hand on to the processes it starts (``command`` and
# ``func`` are the subcommand's own entries in the namespace).
_NOT_RELAUNCHED = ("command", "func", "nproc")
# Options that set the TrainConfig field of the same name.
_TRAIN_OPTIONS = (
    "steps", "batch_size", "length", "lr", "warmup", "weight_decay", "seed", "eval_every",
    "checkpoint_every", "pad",
)
# The value an option takes when it is not given (and not read from a checkpoint). In the
# namespace an option not given is None, so --resume can tell it from one given.
DEFAULTS: dict[str, Any] = {
    "task": None, "text": None, "lines": False, "distances": None, "length": 64,
    "eval_lengths": None, "pad": False,
    "layers": 2, "heads": 4, "d_model": 64, "ff": None, "max_distance": 16,
    "no_rel_keys": False, "no_rel_values": False, "per_head": False, "positions": "relative",
    "bidirectional": False, "dropout": 0.0,
    "steps": 300, "batch_size": 32, "lr": 3e-3, "warmup": 20, "weight_decay": 0.01, "seed": 0,
    "eval_every": 100, "checkpoint_every": 100,
}
# Options --resume lets differ from the saved run (they do not change what is learned; for
# --steps see the module docstring).
_FREE_ON_RESUME = ("steps", "eval_lengths", "eval_every", "checkpoint_every")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The ``model`` options of ``relpos train`` (read by :func:`build_model_config`)."""
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=positive_int, help="transformer blocks (default 2)")
    g.add_argument("--heads", type=positive_int, help="attention heads (default 4)")
    g.add_argument("--d-model", type=positive_int, help="model width (default 64)")
    g.add_argument("--ff", type=positive_int, help="MLP width (default 4*d-model)")
    _args.add_max_distance(
        g, None, f"clip distance K of the relative positions, 0..{MAX_DISTANCE} (default 16)",
        maximum=MAX_DISTANCE,
    )
    g.add_argument("--no-rel-keys", action="store_true", default=None,
                   help="drop the relative key term")
    g.add_argument("--no-rel-values", action="store_true", default=None,
                   help="drop the relative value term")
    g.add_argument("--per-head", action="store_true", default=None,
                   help="one relative table per head (default: shared)")
    g.add_argument("--positions", choices=POSITIONS,
                   help="relative (default) or an absolute baseline without relative terms")
    g.add_argument("--bidirectional", action="store_true", default=None,
                   help="no causal mask (encoder)")
    g.add_argument("--dropout", type=_args.float_in(0.0, 1.0), help="dropout rate (default 0)")


SUMMARY = "train a small relative-position transformer"
DESCRIPTION = """\
Train a small transformer with clipped relative positions (or an absolute baseline) on a
built-in synthetic task or a text file, with AdamW, warmup and cosine decay, periodic
evaluation and crash-safe checkpoints. --out must not hold another run (checkpoints/,
metrics.json) unless --resume continues it or --overwrite replaces it. --resume reads the
run's settings from its checkpoint: leave the options out (those given must agree with the
saved ones); --eval-lengths, --eval-every and --checkpoint-every may differ, and --steps: a
larger one trains longer on the run's learning-rate schedule (the floor rate after its end),
a smaller one (not below the checkpoint's step) stops earlier; a run that already finished
them is left as it is. --text FILE --lines trains on
the lines of FILE (one line an example, up to --length tokens, batched by a budget of
--batch-size x --length tokens) padding-free: the lines go through the model packed end to
end, so no compute is spent on padding; --pad runs the same batches padded with a key mask
instead, to compare (the same losses to float tolerance). Losses are cross-entropies in
nats per scored position (bits beside; the experiment report uses bits per character);
--no-progress hides the bar, not the evaluation lines; its tok_s counts real tokens.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos train``."""
    g = p.add_argument_group("data")
    g.add_argument("--task", metavar="NAME",
                   help="recall (default), agree, sort or text (implied by --text)")
    g.add_argument("--text", metavar="FILE", help="character-level LM on FILE")
    g.add_argument("--lines", action="store_true", default=None,
                   help="with --text: one line of FILE an example (a line longer than "
                        "--length + 1 characters gives a random window of it), batches of "
                        "--batch-size x --length tokens, trained packed (no compute on "
                        "padding)")
    g.add_argument("--pad", action="store_true", default=None,
                   help="with --lines: train on padded batches with a key mask instead of "
                        "packing, to compare")
    g.add_argument("--distances", type=_args.int_list(1), metavar="D,D,...",
                   help="dependency distances of recall/agree (default: the task's, up to 32)")
    g.add_argument("--length", type=_args.int_in(1, MAX_LENGTH), metavar="N",
                   help=f"training length, 1..{MAX_LENGTH} (default 64)")
    g.add_argument("--eval-lengths", type=_args.int_list(1, MAX_LENGTH), metavar="N,N,...",
                   help="lengths evaluated at the end (default: the training length)")
    add_model_arguments(p)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=positive_int,
                   help="steps (default 300; with --resume: the saved run's)")
    g.add_argument("--batch-size", type=positive_int,
                   help="global batch size (default 32; with --lines a budget of batch-size "
                        "x length tokens)")
    g.add_argument("--lr", type=_args.positive_float, help="peak learning rate (3e-3)")
    g.add_argument("--warmup", type=non_negative_int, help="warmup steps (20)")
    g.add_argument("--weight-decay", type=_args.non_negative_float,
                   help="AdamW weight decay, a finite number >= 0 (0.01)")
    g.add_argument("--seed", type=_args.seed, help="seed (default 0)")
    g = p.add_argument_group("run")
    g.add_argument("--out", default="runs/train", metavar="DIR",
                   help="output directory (default runs/train)")
    used = g.add_mutually_exclusive_group()
    used.add_argument("--resume", action="store_true",
                      help="continue the run in --out with its saved settings")
    used.add_argument("--overwrite", action="store_true",
                      help="replace the run in --out (removes its checkpoints/ and "
                           "metrics.json first)")
    g.add_argument("--eval-every", type=non_negative_int,
                   help="eval period (default 100; 0 = end only)")
    g.add_argument("--checkpoint-every", type=non_negative_int,
                   help="checkpoint period (default 100; 0 = end only)")
    _args.add_threads(g, "torch CPU threads per process (default 1; fixed for reproducible "
                         "numbers)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--nproc", type=positive_int, metavar="N",
                   help="train data-parallel in N processes (launches torchrun on 127.0.0.1)")
    _args.add_no_progress(g)
    g = p.add_argument_group(
        "scaling (over the processes of --nproc or torchrun; none changes what is learned, "
        "so each may differ on --resume)")
    g.add_argument("--context-parallel", type=positive_int, metavar="C",
                   help="shard each sequence over C processes (context parallelism; the "
                        "process count must be a multiple of C; default 1)")
    g.add_argument("--cp-mode", choices=("ring", "all_gather"),
                   help="context-parallel attention: ring (memory per process falls as 1/C) "
                        "or all_gather (gathers keys and values; default ring)")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="shard weights, gradients and optimizer state with FSDP2 instead of "
                        "replicating them (DDP)")
    g.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute each block's activations in the backward (less memory, "
                        "about one more forward)")


def _value(args: argparse.Namespace, name: str) -> Any:
    """The option's value, or its default when it was not given."""
    value = getattr(args, name, None)
    return DEFAULTS.get(name) if value is None else value


def build_model_config(args: argparse.Namespace, vocab_size: int, max_length: int) -> Any:
    from relpos.models import ModelConfig

    def v(name: str) -> Any:
        return _value(args, name)

    relative = v("positions") == "relative"
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=v("d_model"),
        num_layers=v("layers"),
        num_heads=v("heads"),
        dim_feedforward=v("ff"),
        max_distance=v("max_distance") if relative else 0,
        relative_keys=relative and not v("no_rel_keys"),
        relative_values=relative and not v("no_rel_values"),
        share_heads=not v("per_head"),
        positions=v("positions"),
        max_length=max_length,
        dropout=v("dropout"),
        causal=not v("bidirectional"),
    )


def relaunch_argv(args: argparse.Namespace) -> list[str]:
    """The ``relpos train`` arguments that reproduce ``args`` in the processes a ``--nproc``
    launch starts, without ``--nproc``.

    Every option of ``relpos train`` stores its value under its own name (``--batch-size``
    in ``batch_size``), so the namespace itself lists them: each one set is handed on
    (flags that are on, values that are not None); options not given stay not given, so
    the processes resolve them as this one does (defaults, or the checkpoint's).
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def saved_options(saved: Any) -> dict[str, Any]:
    """The option values of ``relpos train`` a saved run (a
    :class:`relpos.training.trainer.SavedRun`) was trained with; None where an option has
    no effect on it (``-k`` of an absolute-position model)."""
    m, t, task = saved.model, saved.train, saved.task
    relative = m.positions == "relative"
    return {
        "task": task.get("name"),
        "text": task.get("path"),
        "lines": task.get("unit") == "line",
        "pad": t.pad,
        "distances": tuple(task["distances"]) if "distances" in task else None,
        "length": t.length,
        "eval_lengths": tuple(t.eval_lengths),
        "layers": m.num_layers,
        "heads": m.num_heads,
        "d_model": m.d_model,
        "ff": m.ffn_dim,
        "max_distance": m.max_distance if relative else None,
        "no_rel_keys": (not m.relative_keys) if relative else None,
        "no_rel_values": (not m.relative_values) if relative else None,
        "per_head": not m.share_heads,
        "positions": m.positions,
        "bidirectional": not m.causal,
        "dropout": m.dropout,
        "steps": t.steps,
        "batch_size": t.batch_size,
        "lr": t.lr,
        "warmup": t.warmup,
        "weight_decay": t.weight_decay,
        "seed": t.seed,
        "eval_every": t.eval_every,
        "checkpoint_every": t.checkpoint_every,
    }


def _conflicts(args: argparse.Namespace, saved: dict[str, Any]) -> list[str]:
    """The options given on the command line that disagree with the saved run."""
    given = {name: getattr(args, name) for name in DEFAULTS if getattr(args, name) is not None}
    if given.get("text") is not None:
        given.setdefault("task", "text")
    out = []
    for name, value in given.items():
        if name in _FREE_ON_RESUME or (saved.get(name) is None and name != "distances"):
            continue
        was = saved[name]
        if name == "text":
            same = os.path.realpath(value) == os.path.realpath(str(was))
        else:
            same = value == was
        if not same:
            flag = "-k" if name == "max_distance" else _flag(name)
            shown = "(none)" if was is None else _shown(was)
            out.append(f"{flag}{'' if value is True else ' ' + _shown(value)} "
                       f"(the checkpoint: {shown})")
    return out


def _resume_settings(
    args: argparse.Namespace, out: Path, *, say: bool
) -> tuple[Any, Any, Any] | None:
    """(task, model config, train config) of ``--resume``: the saved run's, with the
    options it lets differ; ``say``: print where it resumes. None when the run already
    finished the steps asked for (rank 0 says so in one line; nothing is written)."""
    from relpos.training.resume import finished
    from relpos.training.tasks import task_from_config
    from relpos.training.trainer import read_saved_run

    saved = read_saved_run(out)
    options = saved_options(saved)
    conflicts = _conflicts(args, options)
    if conflicts:
        raise CLIError(
            f"cannot resume {str(out)!r} with a different configuration: "
            f"{'; '.join(conflicts[:4])}{'; ...' if len(conflicts) > 4 else ''}; leave these "
            "options out to use the saved ones, or pass --overwrite to start a new run"
        )
    steps = options["steps"] if args.steps is None else args.steps
    if steps < saved.step:
        raise CLIError(
            f"--steps {steps} is below the step of the checkpoint in {str(out)!r}, "
            f"{saved.step}; allowed: {saved.step} or more"
        )
    if finished(out, saved, steps):
        if _rank() == 0:
            print(f"{out} already finished {steps} steps; pass --steps N > {steps} to train "
                  "longer", flush=True)
        return None
    changes: dict[str, Any] = {"steps": steps, "schedule_steps": saved.train.schedule}
    for name in ("eval_every", "checkpoint_every"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.eval_lengths is not None:
        changes["eval_lengths"] = tuple(args.eval_lengths)
    config = dataclasses.replace(saved.train, **changes)
    task = task_from_config(saved.task)
    if say:
        print(resume_line(out, saved.step, steps, config), flush=True)
    return task, saved.model, config


def resume_line(out: Path, step: int, steps: int, config: Any) -> str:
    """What ``--resume`` says: from which step to which, and what the learning rate does
    where ``steps`` is not the run's schedule (``config``: its TrainConfig; the schedule
    keeps the length the run started with)."""
    schedule = config.schedule
    said = f"resuming {out} at step {step} of {steps}"
    if steps == schedule:
        return said
    if steps < schedule:
        return (f"{said}, before the end of its learning-rate schedule ({schedule} steps, "
                "which stays as it was)")
    floor = config.lr * config.min_lr_ratio
    first = max(step, schedule) + 1
    beyond = f"step {steps} trains" if first == steps else f"steps {first}-{steps} train"
    if step >= schedule:
        return (f"{said}: its learning-rate schedule ended at step {schedule}, so {beyond} "
                f"at its floor rate, {floor:g}")
    return (f"{said}: its learning-rate schedule still ends at step {schedule} (it keeps "
            f"the length the run started with), and {beyond} at its floor rate, {floor:g}")


def _new_settings(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(task, model config, train config) of a new run, from the options and defaults."""
    from relpos.training import TrainConfig
    from relpos.training.tasks import TASKS, build_task

    name = args.task or ("text" if args.text else "recall")
    if name not in TASKS:
        raise CLIError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}")
    if args.lines and name != "text":
        raise CLIError(f"--lines is for task 'text' (--text FILE), not {name!r}")
    task = build_task(name, distances=args.distances, text=args.text,
                      unit="line" if args.lines else None)
    if args.pad and not task.variable_length:
        what = "windows of --length characters" if name == "text" else "fixed-length rows"
        raise CLIError(f"--pad compares padded with packed training of variable-length "
                       f"batches (--text FILE --lines); task {name!r} has {what}, with no "
                       "padding")
    length = _value(args, "length")
    eval_lengths = tuple(args.eval_lengths or (length,))
    model_config = build_model_config(args, task.vocab_size, max(length, *eval_lengths))
    config = TrainConfig(
        **{name: _value(args, name) for name in _TRAIN_OPTIONS}, eval_lengths=eval_lengths
    )
    return task, model_config, config


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _out_of_memory(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, MemoryError) or any(
        s in text for s in ("can't allocate memory", "not enough memory", "out of memory")
    )


def parallelism(args: argparse.Namespace) -> Any:
    """The :class:`relpos.training.mesh_parallel.Parallelism` the scaling options ask for."""
    from relpos.training.mesh_parallel import Parallelism

    return Parallelism(
        context_parallel=args.context_parallel or 1,
        mode=args.cp_mode or "ring",
        fsdp=bool(args.fsdp),
        activation_checkpointing=bool(args.activation_checkpointing),
    )


def _preflight(args: argparse.Namespace, out: Path, launching: bool) -> tuple[Any, Any, Any] | None:
    """(task, model config, train config) of the run asked for, or None when ``--resume``
    finds it finished; raises CLIError (or ValueError, OSError) to refuse it. Writes
    nothing."""
    if args.text is not None and not Path(args.text).is_file():
        what = "is a directory" if Path(args.text).is_dir() else "does not exist"
        raise CLIError(f"text file {args.text!r} {what}; allowed: a UTF-8 text file")

    from relpos.training.trainer import check_setup, previous_run

    if args.resume:
        say = not launching and _rank() == 0  # the processes launched say it
        settings = _resume_settings(args, out, say=say)
        if settings is None:  # finished already: nothing to train, nothing written
            return None
        task, model_config, config = settings
    else:
        task, model_config, config = _new_settings(args)
    check_setup(model_config, task, config)  # here, not in each launched process
    world = args.nproc if launching else int(os.environ.get("WORLD_SIZE", "1"))
    what = f"--nproc {world}" if launching else f"the {world} processes"
    parallel = parallelism(args)
    cp = parallel.context_parallel
    if world == 1 and cp > 1:
        raise CLIError(f"--context-parallel {cp} shards each sequence over {cp} processes; "
                       f"pass --nproc {cp} (or a multiple of {cp}) or launch with torchrun")
    if world % cp:
        raise CLIError(f"--context-parallel {cp} must divide {what} (allowed: a divisor of "
                       f"{world}; --nproc {cp}, {2 * cp}, ... for {cp})")
    if parallel.fsdp and world == 1:
        raise CLIError("--fsdp shards over processes; pass --nproc N (N >= 2) or launch "
                       "with torchrun")
    if cp > 1 and task.variable_length and not config.pad:
        raise CLIError(f"--context-parallel shards padded batches; task {task.name!r} has "
                       "rows of different lengths, trained packed: add --pad")
    dp = world // cp
    if config.batch_size % dp:
        shards = what if cp == 1 else f"the {dp} data-parallel groups of {what} / " \
            f"--context-parallel {cp}"
        raise CLIError(f"--batch-size {config.batch_size} must be divisible by {shards}")
    # Every rank checks --out (before any process group exists), so under torchrun every
    # rank refuses a used --out itself.
    if not args.resume and not args.overwrite:
        found = previous_run(out)
        if found:
            raise CLIError(
                f"--out {str(out)!r} already holds a run "
                f"({', '.join(p.name for p in found)}); pass --resume to continue it, "
                "--overwrite to replace it, or choose another --out"
            )
    return task, model_config, config


def run(args: argparse.Namespace) -> int:
    out = _args.check_output_dir(args.out)
    launching = args.nproc is not None and "WORLD_SIZE" not in os.environ
    processes = args.nproc if launching else int(os.environ.get("WORLD_SIZE", "1") or 1)
    distributed = not launching and processes > 1
    if distributed:
        _interrupt.watch()
    try:
        return _run(args, out, launching)
    except (Exception, KeyboardInterrupt) as err:
        if not _interrupt.is_interrupt(err, distributed=distributed):
            raise
        if _interrupt.says(distributed):  # one process: not each rank, not a traceback
            print(_interrupt.line(out, processes), file=sys.stderr, flush=True)
        return _interrupt.exit_status()


def oversubscribed(processes: int, threads: int, cores: int) -> str | None:
    """The warning for ``processes`` of ``threads`` torch threads each on ``cores`` usable
    CPU cores, or None when they fit."""
    if processes * threads <= cores:
        return None
    fits = max(1, cores // threads)
    return (f"relpos: warning: --nproc {processes} with {threads} torch thread(s) each asks "
            f"for {processes * threads} cores, and this process may use {cores}: the "
            f"processes will share them, each slower (--nproc {fits} fills them)")


def _warn_if_oversubscribed(args: argparse.Namespace, processes: int) -> None:
    """Warn once (the launching process, or rank 0 under torchrun) when the processes of a
    CPU run would ask for more cores than this process may use."""
    import torch

    from relpos._sysinfo import usable_cores

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    warning = None if on_cuda else oversubscribed(processes, args.threads or 1,
                                                  usable_cores())
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, out: Path, launching: bool) -> int:
    import torch

    from relpos.training import init_distributed, launch, train
    from relpos.training.data_parallel import refuse_together, shutdown
    from relpos.training.trainer import clear_run, previous_run, summarize

    ranks = 1 if launching else int(os.environ.get("WORLD_SIZE", "1"))
    if ranks == 1:
        settings = _preflight(args, out, launching)
    else:
        # Under torchrun a rank that refuses says why in one line and exits with status 2
        # only once every rank knows, so torchrun stops none of them first: each one exits
        # 2, with one line (the first refusal, in rank order, for a rank that had none).
        try:
            settings = _preflight(args, out, launching)
        except (CLIError, ValueError, OSError) as err:
            print(f"relpos: error: {_one_line(err)}", file=sys.stderr, flush=True)
            refuse_together(_one_line(err))
            return 2
        refusal = refuse_together(None)
        if refusal is not None:
            print(f"relpos: error: {refusal}", file=sys.stderr, flush=True)
            return 2
    if settings is None:
        return 0
    task, model_config, config = settings
    if args.overwrite and _rank() == 0:
        found = previous_run(out)
        if found:
            clear_run(out)
            print(f"--overwrite: removed the previous run's {', '.join(p.name for p in found)} "
                  f"from {out}", flush=True)

    if launching or (ranks > 1 and not _interrupt.silent()):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks) or ranks)
        _warn_if_oversubscribed(args, args.nproc if launching else local)
    if launching:
        status = launch(args.nproc, relaunch_argv(args))
        if status:
            raise CLIError(f"the {args.nproc}-process run failed with exit status {status}")
        return 0

    torch.set_num_threads(args.threads or 1)
    ctx = init_distributed(args.device)
    try:
        metrics = train(
            model_config,
            task,
            config,
            out_dir=out,
            resume=args.resume,
            progress=not args.no_progress,
            ctx=ctx,
            log=print,
            parallel=parallelism(args),
        )[1]  # the model is not kept: it is freed before the process group is left
    except RuntimeError as err:
        if not _out_of_memory(err):
            raise
        raise CLIError(
            f"out of memory ({str(err).splitlines()[0][:160]}); try a smaller --batch-size, "
            "--length, --d-model, --layers or -k"
        ) from None
    finally:
        shutdown(ctx)
    if ctx.is_main:
        for line in summarize(metrics):
            print(line)
        print(f"metrics: {out / 'metrics.json'}")
    return 0


# Argument types that lived here before relpos.cli._args.
__getattr__ = module_getattr(__name__, {
    "int_list": ("relpos.cli._args.int_list(1)", lambda: _args.int_list(1)),
    "positive_float": moved("relpos.cli._args.positive_float"),
})
