"""Checking an export against relpos (:func:`check_ctranslate2`): log-probs over the whole
vocabulary at every prompt position and greedy tokens, for one prompt and a ragged batch."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos.export.ctranslate2.format import CTranslate2ExportError
from relpos.export.ctranslate2.loading import (
    generate_new_tokens,
    load_generator,
    load_vocabulary,
    read_metadata,
)
from relpos.export.ctranslate2.mapping import check_model
from relpos.models import ModelConfig, RelativeTransformerLM

__all__ = ["CTranslate2Case", "CTranslate2Check", "check_ctranslate2"]


@dataclasses.dataclass(frozen=True)
class CTranslate2Case:
    """One comparison: a batch of prompts run in both engines.

    Attributes:
        name: ``"batch 1"`` or ``"ragged batch"``.
        lengths: the prompt lengths.
        max_logprob_diff: largest ``|log p_relpos - log p_ct2|`` over every prompt position
            and the whole vocabulary.
        relpos_tokens: relpos's greedy continuation of each prompt.
        ct2_tokens: CTranslate2's.
    """

    name: str
    lengths: tuple[int, ...]
    max_logprob_diff: float
    relpos_tokens: tuple[tuple[int, ...], ...]
    ct2_tokens: tuple[tuple[int, ...], ...]

    @property
    def greedy_match(self) -> bool:
        return self.relpos_tokens == self.ct2_tokens


@dataclasses.dataclass(frozen=True)
class CTranslate2Check:
    """What :func:`check_ctranslate2` measured.

    Attributes:
        cases: the batch-1 case and the ragged-batch case.
        max_new_tokens: greedy tokens generated per prompt.
    """

    cases: tuple[CTranslate2Case, ...]
    max_new_tokens: int

    @property
    def max_logprob_diff(self) -> float:
        return max(c.max_logprob_diff for c in self.cases)

    @property
    def greedy_match(self) -> bool:
        return all(c.greedy_match for c in self.cases)

    def ok(self, atol: float = 1e-4) -> bool:
        """Log-probs within ``atol`` and identical greedy tokens."""
        return self.max_logprob_diff <= atol and self.greedy_match


def _prompts(
    prompt_ids: Any, cfg: ModelConfig, max_new_tokens: int, seed: int
) -> list[list[int]]:
    """The prompts as lists of ids: given, or drawn from ``seed``."""
    limit = cfg.max_length - max_new_tokens if cfg.positions == "learned" else None
    if limit is not None and limit < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt within "
            f"max_length={cfg.max_length} of the learned positions"
        )
    if prompt_ids is None:
        gen = torch.Generator().manual_seed(seed)
        lengths = [7, 3, 1, 10]
        if limit is not None:
            lengths = [max(1, min(n, limit)) for n in lengths]
        return [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    if isinstance(prompt_ids, Tensor):
        prompt_ids = prompt_ids.tolist() if prompt_ids.dim() == 2 else [prompt_ids.tolist()]
    try:
        prompts = [[int(i) for i in p] for p in prompt_ids]
    except (TypeError, ValueError):
        raise TypeError(
            "prompt_ids must be a (B, P) tensor or a sequence of sequences of token ids"
        ) from None
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_ids needs at least one prompt, each of at least one token")
    flat = [i for p in prompts for i in p]
    if min(flat) < 0 or max(flat) >= cfg.vocab_size:
        raise ValueError(
            f"prompt_ids must be in [0, vocab_size={cfg.vocab_size}), got values in "
            f"[{min(flat)}, {max(flat)}]"
        )
    if limit is not None and max(len(p) for p in prompts) > limit:
        raise ValueError(
            f"prompts of up to {max(len(p) for p in prompts)} tokens + {max_new_tokens} new "
            f"exceed max_length={cfg.max_length} of the learned positions"
        )
    return prompts


@torch.no_grad()
def _relpos_logprobs(model: RelativeTransformerLM, prompt: list[int]) -> Tensor:
    """``(P, V)`` float64 log-probs of one prompt, from a full forward pass."""
    device = model.embed.weight.device
    logits = model(torch.tensor([prompt], device=device))[0]  # (P, V)
    return F.log_softmax(logits.double(), dim=-1).cpu()


@torch.no_grad()
def _relpos_greedy(model: RelativeTransformerLM, prompt: list[int], n: int) -> tuple[int, ...]:
    """``n`` greedy tokens, one full forward pass each (independent of ``generate``)."""
    device = model.embed.weight.device
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids], device=device))[0, -1]  # (V,)
        ids.append(int(logits.argmax()))
    return tuple(ids[len(prompt):])


def check_ctranslate2(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    prompt_ids: Any = None,
    max_new_tokens: int = 8,
    compute_type: str = "default",
    intra_threads: int = 1,
    seed: int = 0,
) -> CTranslate2Check:
    """Run an exported directory in CTranslate2 and ``model`` in relpos on the same prompts.

    Two cases: the first prompt alone (batch 1), and every prompt at once (a ragged batch:
    prompts of different lengths). For each, the log-probs of the whole vocabulary at every
    prompt position (CTranslate2: ``Generator.forward_batch(ids, return_log_probs=True)``,
    which pads the ragged batch and masks by length; relpos: ``log_softmax`` of
    ``model(ids)``, one prompt at a time), and ``max_new_tokens`` greedy tokens
    (CTranslate2: ``generate_batch(..., sampling_topk=1, include_prompt_in_result=False,
    end_token=[])``; relpos: argmax of a full forward pass per token, not
    ``model.generate``).

    Args:
        model: the relpos model that was exported (run in eval mode, restored after).
        path: the directory :func:`to_ctranslate2` wrote.
        prompt_ids: a ``(B, P)`` tensor or B sequences of ids (different lengths allowed);
            None = 4 prompts of lengths 7, 3, 1, 10 drawn from ``seed``.
        max_new_tokens: greedy tokens per prompt.
        compute_type: CTranslate2's compute type (see :func:`load_generator`).
        intra_threads: CTranslate2 threads.
        seed: draws the default prompts.

    Returns:
        A :class:`CTranslate2Check`; ``.max_logprob_diff``, ``.greedy_match``, ``.ok(atol)``.

    Raises:
        CTranslate2ExportError: ``model`` cannot be exported (so it cannot match).
        CTranslate2MissingError: ``ctranslate2`` is not installed.
    """
    lm = check_model(model)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
        max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    meta = read_metadata(path)
    # The metadata went through JSON (a window (K, K) reads back as [K, K]): compare as JSON.
    if meta.get("config") != json.loads(json.dumps(lm.config.to_dict())):
        raise CTranslate2ExportError(
            f"{str(path)!r} was exported from another configuration than this model's"
        )
    prompts = _prompts(prompt_ids, lm.config, max_new_tokens, seed)
    tokens = load_vocabulary(path)
    generator = load_generator(path, compute_type=compute_type, intra_threads=intra_threads)
    reference = copy.deepcopy(lm).float().eval() if lm.embed.weight.dtype != torch.float32 else lm
    was_training = lm.training
    reference.eval()
    try:
        cases = [
            _case(generator, reference, tokens, name, batch, max_new_tokens)
            for name, batch in (("batch 1", prompts[:1]), ("ragged batch", prompts))
            if name == "batch 1" or len(prompts) > 1
        ]
    finally:
        lm.train(was_training)
    return CTranslate2Check(tuple(cases), max_new_tokens)


def _case(
    generator: Any, model: RelativeTransformerLM, tokens: list[str], name: str,
    prompts: list[list[int]], n: int,
) -> CTranslate2Case:
    import numpy as np

    out = np.asarray(generator.forward_batch(prompts, return_log_probs=True))  # (B, P, V)
    worst = 0.0
    for b, prompt in enumerate(prompts):
        got = torch.from_numpy(out[b, : len(prompt)].astype(np.float64))  # (P, V)
        want = _relpos_logprobs(model, prompt)
        diff = float((got - want).abs().max())
        worst = max(worst, diff if math.isfinite(diff) else math.inf)  # NaN counts as inf
    new = generate_new_tokens(generator, [[tokens[i] for i in p] for p in prompts], n)
    ct2_tokens = tuple(tuple(seq) for seq in new)
    relpos_tokens = tuple(_relpos_greedy(model, p, n) for p in prompts)
    return CTranslate2Case(
        name, tuple(len(p) for p in prompts), worst, relpos_tokens, ct2_tokens
    )
