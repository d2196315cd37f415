"""The documentation site builds offline in strict mode (``mkdocs build --strict``).

Needs the ``dev`` extra (mkdocs, mkdocstrings-python); without it this test skips locally and
fails in CI (``CI=true``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict(tmp_path):
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"mkdocs is missing in CI (install the dev extra): {missing}")
        pytest.skip(f"needs mkdocs and mkdocstrings-python (missing {missing})")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    api = (site / "api" / "index.html").read_text()
    for name in ("relative_attention", "RelativeMultiheadAttention", "resize_relative_table",
                 "load_state_dict_resized", "save_module", "export_onnx", "KVCache",
                 "RelativeTransformerLM", "ModelConfig", "TrainConfig", "save_checkpoint",
                 "relpos.integrations.transformers", "is_patched", "to_ctranslate2"):
        assert name in api, name
    conventions = (site / "conventions" / "index.html").read_text()
    assert "query 2 (p=4)   0  0  0  0  1" in conventions  # the bottom-right index matrix
    home = (site / "index.html").read_text()
    assert "Shape legend" in home and "R = 2K + 1" in home
