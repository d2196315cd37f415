"""The benchmark harness behind ``relpos bench``: timings and peak memory against plain
``F.scaled_dot_product_attention`` measured in the same run, and reports with the hardware,
versions, date and command.

Modules:
    :mod:`relpos.bench.attention`: whole-sequence attention, forward and forward + backward,
        every backend (``relpos bench``).
    :mod:`relpos.bench.decode`: one KV-cache decode step (``relpos bench --decode``).
    :mod:`relpos.bench.presets`: every backend at training shapes, a fixed number of tokens
        per batch (``relpos bench --preset training``).
    :mod:`relpos.bench.encoder`: a training step of a 6-layer encoder of relpos layers
        against the same one of torch's (``relpos bench --preset encoder``).
    :mod:`relpos.bench.common`: interleaved timing rounds and medians, report header and
        files (CSV, markdown).
    :mod:`relpos.bench.memory`: peak memory of one call in a fresh subprocess.
    :mod:`relpos.bench.hardware`: instruction sets and the OpenMP wait policy, for the
        header, the warning when that policy is unset, and the rerun with it set.

The benchmark scripts, each run as ``python -m relpos.bench.NAME``; the optional packages they
compare against load only when they run:
    :mod:`relpos.bench.cuda_check`: the flash_regions and triton backends on a CUDA device.
    :mod:`relpos.bench.w2v_bert`: w2v-BERT 2.0 through relpos against stock transformers.
    :mod:`relpos.bench.ct2_decode`: relpos against CTranslate2 on the same language model.
    :mod:`relpos.bench.eole`: stock eole against eole patched by relpos.
    :mod:`relpos.bench.encoder_variants`: the ``--preset encoder`` models in eval mode, on
        padded batches and with dropout.
    :mod:`relpos.bench.kernel_variants`: the native kernels' portable variants (``relpos
        kernels --build --into``) against this CPU's own build.
    :mod:`relpos.bench.varlen`: packed variable-length batches against padded ones (one
        attention call, a 6-layer encoder step) at the standard library's function lengths.
    :mod:`relpos.bench.generate_packed`: ``RelativeTransformerLM.generate_packed`` against
        ``generate``, end to end, on prompts of equal and of different lengths.

Benchmarks are not tests. The names below load on first use (PEP 562): importing
``relpos.bench`` or :mod:`relpos.bench.common` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relpos._lazy import lazy_exports

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "Config": "relpos.bench.attention",
    "DecodeResult": "relpos.bench.decode",
    "Result": "relpos.bench.attention",
    "build_models": "relpos.bench.encoder",
    "measure_step": "relpos.bench.decode",
    "run_attention": "relpos.bench.attention",
    "run_decode": "relpos.bench.decode",
    "run_encoder": "relpos.bench.encoder",
    "run_training": "relpos.bench.presets",
    "token_shapes": "relpos.bench.presets",
}

__all__ = [
    "Config",
    "DecodeResult",
    "Result",
    "build_models",
    "measure_step",
    "run_attention",
    "run_decode",
    "run_encoder",
    "run_training",
    "token_shapes",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from relpos.bench.attention import Config, Result, run_attention
    from relpos.bench.decode import DecodeResult, measure_step, run_decode
    from relpos.bench.encoder import build_models, run_encoder
    from relpos.bench.presets import run_training, token_shapes
