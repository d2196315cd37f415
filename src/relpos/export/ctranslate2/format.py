"""What a relpos CTranslate2 export holds beside CTranslate2's own files, the errors of the
export, and the one place that imports ``ctranslate2`` (:func:`require_ctranslate2`)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "METADATA",
    "VOCABULARY_FILE",
    "CTranslate2ExportError",
    "CTranslate2MissingError",
    "require_ctranslate2",
]

#: The file beside CTranslate2's that describes the relpos model.
METADATA = "relpos_ct2.json"
FORMAT = "relpos.ctranslate2"
FORMAT_VERSION = 1
#: CTranslate2's vocabulary file (a JSON list, so whitespace tokens survive).
VOCABULARY_FILE = "vocabulary.json"


class CTranslate2ExportError(ValueError):
    """A model (or an argument) that CTranslate2 cannot hold exactly; the message says what
    was received and what is allowed."""


class CTranslate2MissingError(CTranslate2ExportError, ImportError):
    """The ``ctranslate2`` package is not installed (``pip install 'relpos[ct2]'``)."""


def require_ctranslate2() -> Any:
    """The ``ctranslate2`` module.

    Raises:
        CTranslate2MissingError: (a ValueError and an ImportError) if it is not installed.
    """
    try:
        import ctranslate2
    except ImportError as err:
        raise CTranslate2MissingError(
            f"CTranslate2 export needs the 'ct2' extra: pip install 'relpos[ct2]' ({err})"
        ) from None
    return ctranslate2
