"""Export relpos language models to CTranslate2 (extra ``relpos[ct2]``).

CTranslate2's Transformer decoder implements Shaw et al.'s clipped relative attention exactly
as relpos does: ``MultiHeadAttentionSpec`` tables ``relative_position_keys`` and
``relative_position_values`` of ``(2K + 1, D)`` rows shared by every head (K read from the
height of the keys table), row ``clip(j - (i + S - L), -K, K) + K`` for query ``i`` and key
``j`` (bottom-right alignment, as relpos), and one scale ``1 / sqrt(D)`` for ``q·k`` and
``q·aK`` alike. A :class:`relpos.models.RelativeTransformerLM` maps onto
``TransformerDecoderModelSpec.from_config(num_layers, num_heads, pre_norm=True,
activation=Activation.GELU, with_relative_position=True)``, weight by weight::

    relpos                            CTranslate2 (decoder/...)
    embed.weight (x sqrt(E))          embeddings/weight (scale_embeddings=True)
    layers[i].norm1                   layer_i/self_attention/layer_norm
    layers[i].self_attn.in_proj_*     layer_i/self_attention/linear_0 ([Wq; Wk; Wv])
    layers[i].self_attn.out_proj      layer_i/self_attention/linear_1
    layers[i].self_attn.rel_keys      layer_i/self_attention/relative_position_keys
    layers[i].self_attn.rel_values    layer_i/self_attention/relative_position_values
    layers[i].norm2                   layer_i/ffn/layer_norm
    layers[i].linear1, linear2        layer_i/ffn/linear_0, linear_1 (GELU between)
    norm                              layer_norm
    embed.weight (the tied head)      projection/weight
    pos_embed.weight (learned)        position_encodings/encodings

Details that keep the two engines equal:

- **GELU**: relpos uses the exact (erf) GELU, ``F.gelu``; CTranslate2's ``Activation.GELU``
  is the erf form too (``GELUTanh`` is the tanh approximation, not used).
- **Keys-only / values-only**: CTranslate2 reads K from the keys table, and without one it
  adds no relative term and switches on its own sinusoidal positions. A values-only model is
  therefore written with an all-zero keys table of ``2K + 1`` rows (``q·0 = 0``: exact); a
  keys-only model has no values table (CTranslate2 then adds no value term).
- **positions="none"**: one zero keys row (K = 0), so no position encoding is added.
- **positions="learned"**: ``position_encodings/encodings`` holds the ``max_length`` rows,
  added after the ``sqrt(E)`` scaling as in relpos; CTranslate2 refuses longer inputs, as
  relpos does.
- **Layer norm epsilon**: CTranslate2 has one, written to ``config.json``
  (``layer_norm_epsilon``).

**Vocabulary.** The model directory's ``vocabulary.json`` (a JSON list, so whitespace tokens
survive) holds exactly V tokens: token ``i`` is ``str(i)`` (``"0"``, ``"1"``, ...; kind
``"ids"``) unless a vocabulary is given, e.g. the characters of a ``relpos train --text``
run (kind ``"chars"``, see :func:`checkpoint_vocabulary`). CTranslate2 appends its
``unk_token`` when the vocabulary lacks it and stops generating at ``eos_token``; relpos has
no such tokens, so ``unk_token``, ``bos_token`` and ``eos_token`` are all set to token 0,
which keeps V unchanged. Generation must then be told not to stop on it: pass
``end_token=[]`` to ``Generator.generate_batch`` / ``generate_tokens`` (what
:func:`check_ctranslate2` does); an unknown string token is read as token 0 - give tokens
that are in the vocabulary.

Beside CTranslate2's files, ``relpos_ct2.json`` records the relpos configuration and the
vocabulary kind (:func:`read_metadata`).

Refused (:class:`CTranslate2ExportError`, one line): anything but a
:class:`~relpos.models.RelativeTransformerLM` (a ``RelativeTransformerEncoderModel``: CT2's
encoder model returns hidden states and a BERT pooler, it has no per-token or tied output
head), a ``num_classes`` head, per-head tables (``share_heads=False``: CT2's tables are
shared), a window ``max_distance=(left, right)`` with ``left != right`` (CT2's decoder tables
are symmetric), sinusoidal absolute positions (CT2's built-in sinusoid has other frequencies,
a concatenated ``[sin, cos]`` layout and starts at position 1), and layers that are not the
models' own (post-norm, another activation, differing norm epsilons).

Shape legend: B batch, L tokens, E model dim, H heads, D head dim, K clip distance,
R = 2K + 1 table rows, V vocabulary.

Modules: :mod:`~relpos.export.ctranslate2.mapping` (the spec, the refusals, the vocabulary,
:func:`to_ctranslate2`), :mod:`~relpos.export.ctranslate2.loading` (reading an export,
:func:`load_generator`, :func:`generate_new_tokens`), :mod:`~relpos.export.ctranslate2.checking`
(:func:`check_ctranslate2`) and :mod:`~relpos.export.ctranslate2.format` (the files beside
CTranslate2's, the errors). ``ctranslate2`` itself is imported only when a function needs it.
"""

from __future__ import annotations

from relpos.export.ctranslate2.checking import CTranslate2Case, CTranslate2Check, check_ctranslate2
from relpos.export.ctranslate2.format import FORMAT as FORMAT  # public, not in __all__
from relpos.export.ctranslate2.format import FORMAT_VERSION as FORMAT_VERSION
from relpos.export.ctranslate2.format import (
    METADATA,
    CTranslate2ExportError,
    CTranslate2MissingError,
    require_ctranslate2,
)
from relpos.export.ctranslate2.loading import (
    generate_new_tokens,
    load_generator,
    load_vocabulary,
    read_metadata,
)
from relpos.export.ctranslate2.mapping import QUANTIZATIONS, checkpoint_vocabulary, to_ctranslate2

__all__ = [
    "METADATA",
    "QUANTIZATIONS",
    "CTranslate2Case",
    "CTranslate2Check",
    "CTranslate2ExportError",
    "CTranslate2MissingError",
    "check_ctranslate2",
    "checkpoint_vocabulary",
    "generate_new_tokens",
    "load_generator",
    "load_vocabulary",
    "read_metadata",
    "require_ctranslate2",
    "to_ctranslate2",
]
