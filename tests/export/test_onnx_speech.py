"""ONNX export of Hugging Face speech encoders patched with relpos (w2v-BERT 2.0's
``Wav2Vec2BertModel``, SeamlessM4T v2's ``SeamlessM4Tv2SpeechEncoder``): tiny random-weight
models built from configs (nothing downloaded), exported once each with dynamic batch and
length and an ``attention_mask`` input; onnxruntime must match the stock (unpatched, eager)
torch model on padded batches at lengths other than the tracing example's. Needs the ``onnx``
and ``transformers`` extras; without them these tests skip locally and fail in CI
(``CI=true``).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import warnings

import pytest
import torch
from torch import nn

from relpos.export.onnx import check_speech_encoder, export_speech_encoder

EXAMPLE_LENGTH = 16
TOL = 1e-4  # float32
FEATURES = 16


def _require(*packages: str) -> None:
    missing = [m for m in packages if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"an extra is missing in CI: {missing}")
        pytest.skip(f"needs {missing}")


@pytest.fixture(autouse=True)
def _quiet_exporter():
    _require("onnx", "onnxscript", "onnxruntime", "transformers")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _w2v_bert(layers: int = 2, attn: str = "eager") -> nn.Module:
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    torch.manual_seed(0)
    config = Wav2Vec2BertConfig(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
        position_embeddings_type="relative_key", left_max_position_embeddings=6,
        right_max_position_embeddings=2, feature_projection_input_dim=FEATURES,
        conv_depthwise_kernel_size=3, apply_spec_augment=False,
    )
    config._attn_implementation = attn
    model = Wav2Vec2BertModel(config).eval()
    with torch.no_grad():  # make the relative tables matter
        for m in model.modules():
            if hasattr(m, "distance_embedding"):
                m.distance_embedding.weight.mul_(3.0)
    return model


def _seamless_speech_encoder() -> nn.Module:
    from transformers import SeamlessM4Tv2Config
    from transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2 import (
        SeamlessM4Tv2SpeechEncoder,
    )

    torch.manual_seed(0)
    config = SeamlessM4Tv2Config(
        hidden_size=32, speech_encoder_layers=1, speech_encoder_attention_heads=4,
        speech_encoder_intermediate_size=64, feature_projection_input_dim=FEATURES,
        conv_depthwise_kernel_size=3, position_embeddings_type="relative_key",
        left_max_position_embeddings=5, right_max_position_embeddings=2,
        add_adapter=True, num_adapter_layers=1, adaptor_kernel_size=3, adaptor_stride=2,
    )
    return SeamlessM4Tv2SpeechEncoder(config).eval()


def _patched(stock: nn.Module, layers: int = 2) -> nn.Module:
    from relpos.integrations.transformers import patch

    model = copy.deepcopy(stock)
    assert patch(model) == layers  # the adapter's attention has no positions: not patched
    return model


def _batch(B: int, n: int, real: list[int], dtype: torch.dtype = torch.int64, seed: int = 3):
    x = torch.randn(B, n, FEATURES, generator=torch.Generator().manual_seed(seed + n))
    mask = (torch.arange(n)[None, :] < torch.tensor(real)[:, None]).to(dtype)
    return x, mask


@pytest.fixture(scope="module")
def w2v_bert(tmp_path_factory):
    _require("onnx", "onnxscript", "onnxruntime", "transformers")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    stock = _w2v_bert()
    model = _patched(stock).train()  # exported in eval mode, left as it was
    path = tmp_path_factory.mktemp("onnx") / "sub" / "w2v-bert.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        written = export_speech_encoder(model, path, example_length=EXAMPLE_LENGTH)
    assert written == path and model.training
    return stock, path


def test_w2v_bert_graph_has_dynamic_batch_and_length(w2v_bert):
    import onnxruntime as ort

    _, path = w2v_bert
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: (i.shape, i.type) for i in session.get_inputs()}
    assert inputs == {
        "input_features": (["batch", "length", FEATURES], "tensor(float)"),
        "attention_mask": (["batch", "length"], "tensor(int64)"),
    }
    (out,) = session.get_outputs()
    assert out.name == "last_hidden_state" and out.shape == ["batch", "length", 32]
    assert not [p.name for p in path.parent.iterdir() if p.name != path.name]  # no temporaries


@pytest.mark.parametrize(("n", "real"), [
    (5, [5, 3, 1, 4]),          # shorter than the tracing example, padded rows
    (EXAMPLE_LENGTH, [16]),     # batch 1
    (41, [41, 41, 30]),         # longer than the 6 + 2 window and the example
])
def test_w2v_bert_onnxruntime_matches_stock_torch(w2v_bert, n, real):
    import onnxruntime as ort

    stock, path = w2v_bert
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x, mask = _batch(len(real), n, real)
    got = torch.from_numpy(session.run(None, {"input_features": x.numpy(),
                                              "attention_mask": mask.numpy()})[0])
    with torch.no_grad():
        want = stock(x, attention_mask=mask).last_hidden_state
        unmasked = stock(x).last_hidden_state
    keep = mask.bool()
    assert got.shape == want.shape == (len(real), n, 32)
    assert (got - want)[keep].abs().max() < TOL
    if not keep.all():  # the mask is used: without it the real frames of padded rows change
        assert (unmasked - want)[keep].abs().max() > 10 * TOL


def test_w2v_bert_check_speech_encoder_against_stock_sdpa(w2v_bert):
    stock, path = w2v_bert
    sdpa = copy.deepcopy(stock)
    sdpa.config._attn_implementation = "sdpa"
    assert check_speech_encoder(path, sdpa, lengths=(1, 9, 33), batch_size=4) < TOL


def test_seamless_speech_encoder_with_adapter_and_int32_mask(tmp_path):
    stock = _seamless_speech_encoder()
    path = export_speech_encoder(_patched(stock, 1), tmp_path / "speech.onnx",
                                 mask_dtype=torch.int32, example_length=EXAMPLE_LENGTH)
    assert check_speech_encoder(path, stock, lengths=(6, 16, 37), batch_size=3) < TOL

    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[1].type == "tensor(int32)"
    x, mask = _batch(2, 29, [29, 29], torch.int32)  # no padding: every frame is real
    got = torch.from_numpy(session.run(None, {"input_features": x.numpy(),
                                              "attention_mask": mask.numpy()})[0])
    with torch.no_grad():
        want = stock(x, attention_mask=mask).last_hidden_state
    assert got.shape == want.shape == (2, 15, 32)  # the adapter halves the frames
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("variant", ["no-mask", "bool-mask"])
def test_w2v_bert_without_a_mask_input_or_with_a_bool_one(tmp_path, variant):
    stock = _w2v_bert(layers=1)
    masked = variant == "bool-mask"
    path = export_speech_encoder(_patched(stock, 1), tmp_path / "w.onnx", attention_mask=masked,
                                 mask_dtype=torch.bool, example_length=EXAMPLE_LENGTH)
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == (["input_features", "attention_mask"] if masked else ["input_features"])
    for n, real in ((7, [7, 2, 5]), (30, [30, 30])):
        x, mask = _batch(len(real), n, real, torch.bool)
        feeds = {"input_features": x.numpy()}
        if masked:
            feeds["attention_mask"] = mask.numpy()
        got = torch.from_numpy(session.run(None, feeds)[0])
        with torch.no_grad():
            want = stock(x, attention_mask=mask.long() if masked else None).last_hidden_state
        assert (got - want)[mask].abs().max() < TOL
    assert check_speech_encoder(path, stock, lengths=(3, 20)) < TOL


def test_stock_sdpa_w2v_bert_cannot_be_exported(tmp_path):
    """What the README says: transformers' own attention fails the dynamic-length export, so
    export_speech_encoder refuses an unpatched model before trying."""
    stock = _w2v_bert(layers=1, attn="sdpa")

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = stock

        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return self.model(x, attention_mask=m).last_hidden_state

    batch, length = torch.export.Dim("batch", max=64), torch.export.Dim("length", max=4096)
    x, mask = _batch(2, EXAMPLE_LENGTH, [16, 16])
    with pytest.raises(Exception, match=r"(?s)Cannot view a tensor with shape.*as"):
        torch.onnx.export(Wrapper(), (x, mask), dynamo=True, verbose=False,
                          dynamic_shapes={"x": {0: batch, 1: length},
                                          "m": {0: batch, 1: length}})
    with pytest.raises(ValueError, match=r"Wav2Vec2BertModel is not patched.*"
                                         r"relpos\.integrations\.transformers\.patch\(model\)"):
        export_speech_encoder(stock, tmp_path / "stock.onnx")
    assert not list(tmp_path.iterdir())


def test_bad_input_is_refused_with_what_was_received(tmp_path):
    from transformers import BertConfig, BertModel

    model = _patched(_w2v_bert(layers=2))
    with pytest.raises(TypeError, match="got str"):
        export_speech_encoder("facebook/w2v-bert-2.0", tmp_path / "a.onnx")  # type: ignore[arg-type]
    bert = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, vocab_size=50))
    with pytest.raises(TypeError, match=r"cannot export a BertModel.*allowed: "
                                        r"Wav2Vec2BertModel, SeamlessM4Tv2SpeechEncoder"):
        export_speech_encoder(bert, tmp_path / "a.onnx")

    class Whole(nn.Module):  # a model holding a speech encoder, like SeamlessM4Tv2Model
        def __init__(self) -> None:
            super().__init__()
            self.speech_encoder = model

    with pytest.raises(TypeError, match=r"pass its speech encoder, model\.speech_encoder"):
        export_speech_encoder(Whole(), tmp_path / "a.onnx")
    with pytest.raises(TypeError, match=r"mask_dtype must be one of .*got torch\.float32"):
        export_speech_encoder(model, tmp_path / "a.onnx", mask_dtype=torch.float32)
    for bad in (1, 2.5, True):
        with pytest.raises(ValueError, match=rf"example_length must be an int >= 2, got {bad}"):
            export_speech_encoder(model, tmp_path / "a.onnx", example_length=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="example_batch must be an int >= 2, got 1"):
        export_speech_encoder(model, tmp_path / "a.onnx", example_batch=1)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        check_speech_encoder(tmp_path / "a.onnx", model, batch_size=0)
    assert not list(tmp_path.iterdir())
