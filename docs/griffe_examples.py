"""Griffe extension for the API reference: read Google-style ``Example:`` sections (the
spelling relpos's docstrings use) as ``Examples:``, so doctests render as code."""

from __future__ import annotations

import re
import warnings
from typing import Any

import griffe

# With ``force_inspection`` griffe imports every module of the package, the deprecated
# alias ``relpos.bench_decode`` too, whose import warns; the site does not document it.
warnings.filterwarnings("ignore", message=r"relpos\.bench_decode is deprecated",
                        category=DeprecationWarning)

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
