"""Getting relpos modules out of Python: one-file saves, ONNX, CTranslate2.

Modules:
    :mod:`~relpos.export.saving`: :func:`save_module` / :func:`load_module` (one file, or a
        ``relpos train`` checkpoint directory), the registry of classes a save may name.
    :mod:`~relpos.export.onnx`: :func:`export_onnx` (dynamic batch and length) and
        :func:`check_onnx` (onnxruntime against torch); :func:`export_speech_encoder` and
        :func:`check_speech_encoder` for patched Hugging Face w2v-BERT / SeamlessM4T v2 speech
        encoders; the ``onnx`` extra.
    :mod:`~relpos.export.ctranslate2`: :func:`to_ctranslate2` (language models as CTranslate2
        decoders) and :func:`check_ctranslate2`; the ``ct2`` extra.

The names below load their module on first use (PEP 562), so saving a module imports neither
onnx nor ctranslate2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relpos._lazy import lazy_exports

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "FORMAT": "relpos.export.saving",
    "FORMAT_VERSION": "relpos.export.saving",
    "ModuleFormatError": "relpos.export.saving",
    "build_module": "relpos.export.saving",
    "load_module": "relpos.export.saving",
    "module_config": "relpos.export.saving",
    "save_module": "relpos.export.saving",
    "ONNX_PACKAGES": "relpos.export.onnx",
    "check_onnx": "relpos.export.onnx",
    "export_onnx": "relpos.export.onnx",
    "SPEECH_ENCODERS": "relpos.export.onnx",
    "check_speech_encoder": "relpos.export.onnx",
    "export_speech_encoder": "relpos.export.onnx",
    "require_onnx": "relpos.export.onnx",
    "check_ctranslate2": "relpos.export.ctranslate2",
    "to_ctranslate2": "relpos.export.ctranslate2",
}

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ONNX_PACKAGES",
    "SPEECH_ENCODERS",
    "ModuleFormatError",
    "build_module",
    "check_ctranslate2",
    "check_onnx",
    "check_speech_encoder",
    "export_onnx",
    "export_speech_encoder",
    "load_module",
    "module_config",
    "require_onnx",
    "save_module",
    "to_ctranslate2",
]
assert set(__all__) == set(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # static analysers see the eager imports
    from relpos.export.ctranslate2 import check_ctranslate2, to_ctranslate2
    from relpos.export.onnx import (
        ONNX_PACKAGES,
        SPEECH_ENCODERS,
        check_onnx,
        check_speech_encoder,
        export_onnx,
        export_speech_encoder,
        require_onnx,
    )
    from relpos.export.saving import (
        FORMAT,
        FORMAT_VERSION,
        ModuleFormatError,
        build_module,
        load_module,
        module_config,
        save_module,
    )
