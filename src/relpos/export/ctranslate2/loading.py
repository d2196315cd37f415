"""Reading an exported directory (its metadata and vocabulary), running it in CTranslate2
(:func:`load_generator`) and generating new tokens with relpos's conventions
(:func:`generate_new_tokens`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relpos.export.ctranslate2.format import (
    FORMAT,
    FORMAT_VERSION,
    METADATA,
    VOCABULARY_FILE,
    CTranslate2ExportError,
    require_ctranslate2,
)

__all__ = ["generate_new_tokens", "load_generator", "load_vocabulary", "read_metadata"]


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``relpos_ct2.json`` of an exported directory (its ``config`` as a dict).

    Raises:
        FileNotFoundError: if ``path`` holds no ``relpos_ct2.json``.
        CTranslate2ExportError: if it is not one this relpos wrote.
    """
    file = Path(path) / METADATA
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a relpos CTranslate2 export: no {METADATA}"
        )
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise CTranslate2ExportError(f"damaged {str(file)!r}: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CTranslate2ExportError(f"{str(file)!r} is not a relpos CTranslate2 description")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CTranslate2ExportError(
            f"{str(file)!r} has format version {meta.get('format_version')!r}; this relpos "
            f"reads version {FORMAT_VERSION}"
        )
    return meta


def load_vocabulary(path: str | os.PathLike[str]) -> list[str]:
    """The V tokens of an exported directory (``vocabulary.json``; token ``i`` is id ``i``)."""
    file = Path(path) / VOCABULARY_FILE
    try:
        tokens = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(path)!r} has no {VOCABULARY_FILE}") from None
    except ValueError as err:
        raise CTranslate2ExportError(f"damaged {str(file)!r}: {err}") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise CTranslate2ExportError(f"{str(file)!r} is not a JSON list of str tokens")
    return tokens


def load_generator(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    compute_type: str = "default",
    intra_threads: int = 0,
    inter_threads: int = 1,
) -> Any:
    """A ``ctranslate2.Generator`` over an exported directory.

    Args:
        path: a directory written by :func:`to_ctranslate2`.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        compute_type: CTranslate2's compute type (``"default"`` = the stored weight type,
            or the nearest the device supports; ``"float32"``, ``"int8"``, ...).
        intra_threads: threads per generation (0 = CTranslate2's default).
        inter_threads: parallel generations.

    Raises:
        CTranslate2MissingError: ``ctranslate2`` is not installed.
        FileNotFoundError: ``path`` is not a relpos CTranslate2 export.
    """
    ct2 = require_ctranslate2()
    read_metadata(path)
    return ct2.Generator(
        str(path), device=device, compute_type=compute_type, intra_threads=int(intra_threads),
        inter_threads=int(inter_threads),
    )


def generate_new_tokens(
    generator: Any, start_tokens: Sequence[Sequence[str]], max_new_tokens: int,
    **options: Any,
) -> list[list[int]]:
    """``max_new_tokens`` new token ids per prompt from ``generator.generate_batch``.

    Calls ``generate_batch(start_tokens, include_prompt_in_result=False, end_token=[],
    sampling_topk=1, **options)`` (greedy unless ``options`` say otherwise; no stop token,
    see :mod:`relpos.export.ctranslate2`) and returns only the new tokens. CTranslate2 forwards the
    prompts up to the shortest one's length minus one at once and forces the rest; when the
    shortest prompt has a single token nothing is forwarded at once and the result then
    starts with each prompt's tokens after its first, counted in ``max_length``. This
    helper asks for enough tokens and removes them, so every batch gives the same answer.

    Args:
        generator: a ``ctranslate2.Generator`` (:func:`load_generator`).
        start_tokens: B prompts of at least one token each (vocabulary strings).
        max_new_tokens: N >= 1.
        **options: more ``generate_batch`` options (not ``max_length`` or
            ``include_prompt_in_result``).

    Returns:
        B lists of N token ids (fewer if an ``end_token`` in ``options`` stopped one).
    """
    for name in ("max_length", "include_prompt_in_result"):
        if name in options:
            raise TypeError(f"generate_new_tokens sets {name} itself; leave it out")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
        max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    prompts = [list(p) for p in start_tokens]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("start_tokens needs at least one prompt, each of at least one token")
    lengths = [len(p) for p in prompts]
    # The shortest prompt has one token: each result starts with prompt[1:].
    echoed = [n - 1 for n in lengths] if min(lengths) == 1 else [0] * len(prompts)
    options.setdefault("end_token", [])
    options.setdefault("sampling_topk", 1)
    results = generator.generate_batch(
        prompts, max_length=max_new_tokens + max(echoed), include_prompt_in_result=False,
        **options,
    )
    return [
        [int(i) for i in r.sequences_ids[0][skip : skip + max_new_tokens]]
        for r, skip in zip(results, echoed, strict=True)
    ]

