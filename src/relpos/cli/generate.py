"""``relpos generate``: continue a prompt with a trained language model.

``relpos generate runs/text --text "def main("`` reads a ``relpos train --text`` run (its
``--out`` directory or the ``checkpoints/`` in it) and prints the continuation as text, in
the run's character vocabulary. ``--prompt-ids 3,1,4`` takes token ids instead (any
language model: a training run or a file saved with :func:`relpos.export.save_module`) and
prints the new ids. Decoding is greedy with ``--temperature 0`` (or ``--greedy``), sampled
otherwise (``--top-k``, ``--top-p``, ``--seed``); ``--stop`` ends at a stop text or id.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from relpos.cli import CLIError, _args, _one_line

SUMMARY = "continue a prompt with a trained language model"
DESCRIPTION = """\
Continue a prompt with a relpos language model: a relpos train run (its --out directory or
the checkpoints/ in it) or a file saved with relpos.export.save_module. --text needs a run
trained with relpos train --text (its character vocabulary); --prompt-ids works with any
language model. Prints the continuation only.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos generate``."""
    p.add_argument("model", metavar="MODEL",
                   help="relpos train --out directory, checkpoint directory or saved module")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="TEXT", help="the prompt, as text (character models)")
    src.add_argument("--prompt-ids", type=_args.int_list(0), metavar="I,J,...",
                     help="the prompt, as comma-separated token ids")
    p.add_argument("-n", "--max-new-tokens", type=_args.positive_int, default=200,
                   metavar="N", help="tokens to add at most (default 200)")
    p.add_argument("--temperature", type=_args.non_negative_float, default=1.0,
                   help="sampling temperature; 0 = greedy (default 1.0)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (--temperature 0)")
    p.add_argument("--top-k", type=_args.positive_int, default=None, metavar="K",
                   help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=_top_p, default=None, metavar="P",
                   help="nucleus sampling: the most likely tokens holding mass P, in (0, 1]")
    p.add_argument("--stop", metavar="TEXT_OR_ID", action="append", default=None,
                   help="stop after this character (with --text) or token id (with "
                        "--prompt-ids); repeatable")
    p.add_argument("--seed", type=_args.seed, default=0,
                   help="sampling seed (default 0)")
    _args.add_threads(p, "torch CPU threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    given = Path(args.model)
    if not given.exists():
        raise CLIError(f"no such file or directory: {str(given)!r}")
    source = _args.checkpoint_dir(given) if given.is_dir() else given
    chars = _vocabulary(source) if source.is_dir() else None
    if args.text is not None and chars is None:
        raise CLIError(
            f"{str(given)!r} has no text vocabulary (only relpos train --text runs record "
            "their characters); pass the prompt as --prompt-ids"
        )
    if args.text == "":
        raise CLIError("--text is empty; give at least one character")

    import torch

    from relpos.export import load_module
    from relpos.models import RelativeTransformerLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model = load_module(source)
    except RuntimeError as err:  # load_state_dict: missing, unexpected or misshapen weights
        raise CLIError(f"cannot load {str(given)!r}: {_one_line(err, 300)}") from None
    if not isinstance(model, RelativeTransformerLM):
        raise CLIError(
            f"{str(given)!r} holds a {type(model).__name__}; relpos generate needs a language "
            "model (RelativeTransformerLM, e.g. from relpos train --text)"
        )
    vocab = model.config.vocab_size
    if args.text is not None:
        assert chars is not None
        index = {c: i for i, c in enumerate(chars)}
        unknown = sorted({c for c in args.text if c not in index})
        if unknown:
            raise CLIError(
                f"--text has characters the model was not trained on: {''.join(unknown)!r}"
            )
        prompt = [index[c] for c in args.text]
        stop = [_stop_char(s, index) for s in args.stop or ()]
    else:
        prompt = list(args.prompt_ids)
        bad = [i for i in prompt if i >= vocab]
        if bad:
            raise CLIError(f"--prompt-ids {bad[0]} is outside [0, vocab_size={vocab})")
        stop = [_stop_id(s, vocab) for s in args.stop or ()]
    cfg = model.config
    if cfg.positions == "learned" and len(prompt) + args.max_new_tokens > cfg.max_length:
        raise CLIError(
            f"prompt ({len(prompt)}) + --max-new-tokens ({args.max_new_tokens}) exceeds the "
            f"model's learned positions (max_length={cfg.max_length})"
        )
    new = model.generate(
        torch.tensor([prompt]), args.max_new_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k, top_p=args.top_p, eos_token_id=stop or None,
        generator=torch.Generator().manual_seed(args.seed), new_tokens_only=True,
    )[0].tolist()
    if chars is not None and args.text is not None:
        sys.stdout.write("".join(chars[i] for i in new) + "\n")
    else:
        print(" ".join(map(str, new)))
    return 0


def _vocabulary(checkpoints: Path) -> list[str] | None:
    """The characters of a ``relpos train --text`` run, or None for other tasks."""
    from relpos.training.checkpoint import CheckpointError, text_vocabulary

    try:
        chars = text_vocabulary(checkpoints)
    except CheckpointError as err:
        raise CLIError(str(err)) from None
    return None if chars is None else list(chars)


def _stop_char(text: str, index: dict[str, int]) -> int:
    if len(text) != 1:
        raise CLIError(f"--stop takes one character with --text, got {text!r}")
    if text not in index:
        raise CLIError(f"--stop {text!r} is not in the model's vocabulary")
    return index[text]


def _stop_id(text: str, vocab: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise CLIError(f"--stop takes a token id with --prompt-ids, got {text!r}") from None
    if not 0 <= value < vocab:
        raise CLIError(f"--stop {value} is outside [0, vocab_size={vocab})")
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value
