"""ONNX export (``torch.onnx.export(..., dynamo=True)``) with a dynamic sequence axis.

One export per module (slow): an encoder layer saved with ``save_module`` and exported by the
``relpos export-onnx`` command line; onnxruntime must match PyTorch at lengths other than the
tracing example's. Needs the ``onnx`` extra; without it these tests skip locally and fail in CI
(``CI=true``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import relpos
import relpos.export
from relpos.cli import main
from relpos.export import save_module

EXAMPLE_LENGTH = 7
E, HEADS, K = 16, 2, 3


def _require_onnx() -> None:
    packages = ("onnx", "onnxscript", "onnxruntime")
    missing = [m for m in packages if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the onnx extra is missing in CI: {missing}")
        pytest.skip(f"needs the onnx extra (missing {missing})")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    _require_onnx()
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(
        E, HEADS, 32, dropout=0.1, batch_first=True, max_distance=K, implementation="flash_regions"
    )
    with torch.no_grad():  # make the relative tables matter
        for table in (layer.self_attn.rel_keys, layer.self_attn.rel_values):
            assert table is not None
            table.mul_(3.0)
    folder = tmp_path_factory.mktemp("onnx")
    model_path = save_module(layer, folder / "layer.pt")
    onnx_path = folder / "layer.onnx"
    argv = ["export-onnx", str(model_path), "-o", str(onnx_path), "--key-mask", "--check",
            "--example-length", str(EXAMPLE_LENGTH)]
    return layer.eval(), onnx_path, argv


@pytest.fixture(scope="module")
def cli_result(exported):
    import contextlib
    import io

    _, _, argv = exported
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def session(exported, cli_result):
    import onnxruntime as ort

    assert cli_result[0] == 0, cli_result
    return ort.InferenceSession(str(exported[1]), providers=["CPUExecutionProvider"])


def test_cli_exports_and_checks(exported, cli_result):
    code, out, _ = cli_result
    assert code == 0
    assert exported[1].is_file()
    assert f"wrote {exported[1]}" in out
    assert "check: onnxruntime vs PyTorch" in out and out.rstrip().endswith("ok")
    assert sorted(p.name for p in exported[1].parent.iterdir()) == ["layer.onnx", "layer.pt"]


def test_graph_has_dynamic_batch_and_length(session):
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert list(inputs) == ["x", "key_mask"]
    batch, length, features = inputs["x"]
    assert isinstance(batch, str) and isinstance(length, str) and features == E
    assert inputs["key_mask"] == [batch, length]
    assert [o.name for o in session.get_outputs()] == ["out"]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 2, 5, 12, 33])
def test_onnxruntime_matches_pytorch_at_other_lengths(exported, session, batch, length):
    layer = exported[0]
    g = torch.Generator().manual_seed(length * 10 + batch)
    x = torch.randn(batch, length, E, generator=g)
    key_mask = torch.rand(batch, length, generator=g) > 0.3
    key_mask[:, -1] = True
    got = torch.from_numpy(session.run(None, {"x": x.numpy(), "key_mask": key_mask.numpy()})[0])
    with torch.no_grad():
        want = layer(x, src_key_padding_mask=~key_mask)
    assert got.shape == want.shape == (batch, length, E)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if length > 2 * K + 1:  # the relative terms really matter at this length
        with torch.no_grad():
            attn = layer.self_attn
            saved = attn.rel_values.clone()  # type: ignore[union-attr]
            attn.rel_values.zero_()  # type: ignore[union-attr]
            other = layer(x, src_key_padding_mask=~key_mask)
            attn.rel_values.copy_(saved)  # type: ignore[union-attr]
        assert (other - want).abs().max() > 1e-3


def test_missing_extra_is_one_line(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        return None if name == "onnxruntime" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)  # what export.onnx calls
    layer = relpos.RelativeTransformerEncoderLayer(E, HEADS, 32, max_distance=K)
    path = save_module(layer, tmp_path / "m.pt")
    with pytest.raises(ImportError, match=r"pip install 'relpos\[onnx\]' \(missing: onnxruntime\)"):
        relpos.export.export_onnx(layer, tmp_path / "m.onnx")
    assert main(["export-onnx", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "relpos[onnx]" in err and "onnxruntime" in err
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize(
    ("make", "extra", "fragment"),
    [
        (None, [], "no such file or directory"),
        ("bare", [], "not a saved relpos module"),
        ("layer", ["--example-length", "1"], "--example-length must be >= 2"),
        ("layer", ["--atol", "-1"], "must be a number > 0"),
        ("layer", ["-o", "nowhere/x.onnx"], "does not exist"),
    ],
)
def test_cli_user_errors(tmp_path, capsys, make, extra, fragment):
    _require_onnx()
    layer = relpos.RelativeTransformerEncoderLayer(E, HEADS, 32, max_distance=K)
    path = tmp_path / "m.pt"
    if make == "bare":
        torch.save(layer.state_dict(), path)
    elif make == "layer":
        save_module(layer, path)
    argv = ["export-onnx", str(path)]
    if extra[:1] == ["-o"]:
        extra = ["-o", str(tmp_path / extra[1])]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


# --- windows (left, right) ------------------------------------------------------------------

WINDOW = (64, 8)  # w2v-BERT's; the left side is wider than the tracing example (7)


@pytest.fixture(scope="module")
def window_exports(tmp_path_factory):
    _require_onnx()
    import onnxruntime as ort

    from relpos.models import ModelConfig, build_model

    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(
        E, HEADS, 32, dropout=0.0, batch_first=True, max_distance=WINDOW,
    )
    with torch.no_grad():
        for table in (layer.self_attn.rel_keys, layer.self_attn.rel_values):
            assert table is not None
            table.mul_(3.0)
    lm = build_model(ModelConfig(vocab_size=11, d_model=E, num_heads=HEADS, max_distance=(3, 0)))
    folder = tmp_path_factory.mktemp("onnx_windows")
    sessions = {}
    for name, module, key_mask in (("layer", layer, True), ("lm", lm, False)):
        path = relpos.export.export_onnx(module, folder / f"{name}.onnx", key_mask=key_mask,
                                         example_length=EXAMPLE_LENGTH)
        sessions[name] = (module.eval(), path,
                          ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    return sessions


@pytest.mark.parametrize("length", [1, 3, 9, 20, 70, 90])
def test_window_layer_onnx_matches_eager_at_other_lengths(window_exports, length):
    layer, _, session = window_exports["layer"]
    g = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, E, generator=g)
    key_mask = torch.rand(2, length, generator=g) > 0.3
    key_mask[:, -1] = True
    got = torch.from_numpy(session.run(None, {"x": x.numpy(), "key_mask": key_mask.numpy()})[0])
    with torch.no_grad():
        want = layer(x, key_mask=key_mask)
        mirrored = relpos.RelativeTransformerEncoderLayer(
            **{**layer.get_config(), "max_distance": WINDOW[::-1]})
        relpos.load_state_dict_resized(mirrored, layer.state_dict())
        other = mirrored.eval()(x, key_mask=key_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if length > WINDOW[1] + 1:  # the window's right edge clips: (8, 64) would differ
        assert (other - want).abs().max() > 1e-3


def test_window_lm_onnx_matches_eager(window_exports):
    lm, path, _ = window_exports["lm"]
    assert lm.layers[0].self_attn.max_distance == (3, 0)
    assert relpos.export.check_onnx(path, lm, lengths=(1, 4, 13, 30)) < 1e-5
