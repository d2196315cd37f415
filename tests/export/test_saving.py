"""relpos.export's registry: modules give their config, saved files name a registered class."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from torch import nn

import relpos
from relpos.export import (
    FORMAT,
    FORMAT_VERSION,
    ModuleFormatError,
    build_module,
    load_module,
    module_config,
    save_module,
)
from relpos.models import (
    ModelConfig,
    RelativeTransformerEncoderModel,
    RelativeTransformerLM,
    build_model,
)


def _write_v1(path, cls: str, config: dict, state: dict) -> None:
    """A file in format version 1 as the first relpos releases wrote it."""
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, "relpos_version": "0.1.0",
                "class": cls, "config": json.dumps(config), "state_dict": state}, path)


# Constructor arguments as format version 1 spelled them, one per saved class name.
V1_CONFIGS = {
    "RelativeMultiheadAttention": {
        "embed_dim": 8, "num_heads": 2, "max_distance": 3, "relative_keys": True,
        "relative_values": False, "share_heads": True, "dropout": 0.0, "bias": True,
        "kdim": 8, "vdim": 8, "batch_first": True, "implementation": None,
    },
    "RelativeTransformerEncoderLayer": {
        "d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.1, "activation": "relu",
        "layer_norm_eps": 1e-5, "batch_first": True, "norm_first": False, "bias": True,
        "max_distance": 2, "relative_keys": True, "relative_values": True, "share_heads": True,
        "implementation": None,
    },
    "RelativeTransformerDecoderLayer": {
        "d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.1, "activation": "gelu",
        "layer_norm_eps": 1e-5, "batch_first": False, "norm_first": True, "bias": True,
        "max_distance": 2, "relative_keys": True, "relative_values": True,
        "share_heads": False, "implementation": None, "relative_cross_attention": True,
    },
    "RelativeTransformerLM": ModelConfig(vocab_size=11, d_model=8, num_heads=2).to_dict(),
    "RelativeTransformerEncoderModel": ModelConfig(
        vocab_size=11, d_model=8, num_heads=2, causal=False, num_classes=3
    ).to_dict(),
}


# Constructor arguments added since, with the value a version-1 file means.
ADDED_ARGUMENTS = {"RelativeMultiheadAttention": {"add_bias_kv": False, "add_zero_attn": False}}


def _old_projection_names(state: dict) -> dict:
    """A state dict as relpos 0.1 wrote it: q_proj/k_proj/v_proj linears, not
    nn.MultiheadAttention's in_proj_weight/in_proj_bias."""
    old = {}
    for key, value in state.items():
        prefix, _, name = key.rpartition(".") if "." in key else ("", "", key)
        dot = f"{prefix}." if prefix else ""
        if name in ("in_proj_weight", "in_proj_bias"):
            kind = "weight" if name == "in_proj_weight" else "bias"
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3), strict=True):
                old[f"{dot}{proj}.{kind}"] = part.clone()
        else:
            old[key] = value
    return old


@pytest.mark.parametrize("old_names", [False, True])
@pytest.mark.parametrize("cls", sorted(V1_CONFIGS))
def test_version_1_files_of_every_class_load(tmp_path, cls, old_names):
    config = V1_CONFIGS[cls]
    original = build_module({"class": cls, "config": config})
    assert type(original).__name__ == cls
    assert module_config(original) == {
        "class": cls, "config": {**config, **ADDED_ARGUMENTS.get(cls, {})}
    }
    state = original.state_dict()
    if old_names:  # a file written before the projections took nn.MultiheadAttention's names
        state = _old_projection_names(state)
        assert any(k.endswith("q_proj.weight") for k in state)
        assert not any("in_proj" in k for k in state)
    _write_v1(tmp_path / "m.pt", cls, config, state)
    loaded = load_module(tmp_path / "m.pt")
    assert type(loaded) is type(original)
    assert loaded.state_dict().keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_version_1_transformer_encoder_loads(tmp_path):
    layer = V1_CONFIGS["RelativeTransformerEncoderLayer"]
    config = {"layer": layer, "num_layers": 2, "norm_eps": 1e-6, "norm_bias": True}
    original = build_module({"class": "TransformerEncoder", "config": config})
    assert isinstance(original, nn.TransformerEncoder) and len(original.layers) == 2
    assert module_config(original) == {"class": "TransformerEncoder", "config": config}
    _write_v1(tmp_path / "m.pt", "TransformerEncoder", config, original.state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(load_module(tmp_path / "m.pt")(x), original.eval()(x))


def test_models_round_trip_keeps_their_class(tmp_path):
    # A causal encoder model (a left-to-right tagger) stays an encoder model, not an LM.
    for model in (
        build_model(ModelConfig(vocab_size=9, d_model=8, num_heads=2)),
        RelativeTransformerEncoderModel(ModelConfig(vocab_size=9, d_model=8, num_heads=2,
                                                    num_classes=4)),
    ):
        loaded = load_module(save_module(model, tmp_path / "m.pt"))
        assert type(loaded) is type(model) and loaded.config == model.config
        twin = type(model)(**model.get_config())
        assert twin.config == model.config and twin.config is not model.config
    assert isinstance(load_module(tmp_path / "m.pt"), RelativeTransformerEncoderModel)


# Every saved class with a window (left, right) instead of K.
WINDOW_CONFIGS = {
    **{cls: {**config, "max_distance": (5, 1)} for cls, config in V1_CONFIGS.items()
       if "max_distance" in config},
    "RelativeTransformerLM": ModelConfig(vocab_size=11, d_model=8, num_heads=2,
                                         max_distance=(4, 0)).to_dict(),
    "RelativeTransformerEncoderModel": ModelConfig(
        vocab_size=11, d_model=8, num_heads=2, causal=False, num_classes=3,
        max_distance=(0, 6)).to_dict(),
}


def _windows(module: nn.Module) -> set[tuple[int, int]]:
    return {m.window for m in module.modules()
            if isinstance(m, relpos.RelativeMultiheadAttention)}


@pytest.mark.parametrize("cls", sorted(WINDOW_CONFIGS))
def test_windows_round_trip_through_save_and_load_module(tmp_path, cls):
    config = WINDOW_CONFIGS[cls]
    torch.manual_seed(0)
    original = build_module({"class": cls, "config": config}).eval()
    window = tuple(config["max_distance"])
    assert _windows(original) == {window}
    loaded = load_module(save_module(original, tmp_path / "m.pt"))
    assert type(loaded) is type(original) and _windows(loaded) == {window}
    assert module_config(loaded) == module_config(original)  # the pair, not a JSON list
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    state = loaded.state_dict()
    assert all(state[k].tolist() == [2, *window, 1, 1] for k in state
               if k.endswith("_extra_state"))


def test_window_transformer_encoder_round_trips(tmp_path):
    layer = {**V1_CONFIGS["RelativeTransformerEncoderLayer"], "max_distance": (64, 8)}
    config = {"layer": layer, "num_layers": 2, "norm_eps": 1e-6, "norm_bias": True}
    torch.manual_seed(0)
    original = build_module({"class": "TransformerEncoder", "config": config}).eval()
    loaded = load_module(save_module(original, tmp_path / "m.pt"))
    assert _windows(loaded) == {(64, 8)}
    x = torch.randn(2, 70, 8)
    torch.testing.assert_close(loaded(x), original(x), rtol=0, atol=0)


def test_subclass_is_saved_as_its_relpos_class():
    class Mine(relpos.RelativeMultiheadAttention):
        pass

    assert module_config(Mine(8, 2, max_distance=1))["class"] == "RelativeMultiheadAttention"


def test_unsupported_modules_and_specs_raise_naming_what_is_allowed():
    with pytest.raises(ModuleFormatError, match=r"cannot save a Linear; allowed: .*"
                                                r"RelativeMultiheadAttention"):
        module_config(nn.Linear(2, 2))
    layer = relpos.RelativeTransformerEncoderLayer(8, 2, activation=torch.tanh, max_distance=1)
    with pytest.raises(ModuleFormatError, match=r"custom activation .*'relu' or 'gelu'"):
        module_config(layer)
    with pytest.raises(ModuleFormatError, match=r"can only save an nn\.TransformerEncoder"):
        module_config(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), 1,
                                            enable_nested_tensor=False))
    with pytest.raises(ModuleFormatError, match=r"unknown module class 'Nope'.*allowed: "):
        build_module({"class": "Nope", "config": {}})
    with pytest.raises(ModuleFormatError, match="unknown module class"):
        build_module({"class": ["not", "hashable"], "config": {}})
    with pytest.raises(ModuleFormatError, match="bad config for RelativeMultiheadAttention"):
        build_module({"class": "RelativeMultiheadAttention", "config": {"embed_dim": 8}})
    with pytest.raises(ModuleFormatError, match="needs 'class' and 'config'"):
        build_module({"config": {}})


def test_model_config_is_validated_once_per_build(tmp_path, monkeypatch):
    calls = []
    real = ModelConfig.validate
    monkeypatch.setattr(ModelConfig, "validate", lambda self: calls.append(1) or real(self))
    config = ModelConfig(vocab_size=9, d_model=8, num_heads=2)
    assert len(calls) == 1  # __post_init__
    build_model(config)
    RelativeTransformerLM(config)
    assert len(calls) == 1  # consumers take a ModelConfig as valid
    path = save_module(build_model(config), tmp_path / "lm.pt")
    calls.clear()
    load_module(path)
    assert len(calls) == 1  # ModelConfig.from_dict, once


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the exporter's own deprecations
def test_onnx_transformer_encoder_takes_relpos_key_mask(tmp_path):
    packages = ("onnx", "onnxscript", "onnxruntime")
    missing = [m for m in packages if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the onnx extra is missing in CI: {missing}")
        pytest.skip(f"needs the onnx extra (missing {missing})")
    import onnxruntime as ort

    from relpos.export import export_onnx

    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(8, 2, 16, batch_first=True, max_distance=2)
    stack = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8), enable_nested_tensor=False)
    path = export_onnx(stack, tmp_path / "stack.onnx", is_causal=True, key_mask=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 11, 8)
    key_mask = torch.ones(3, 11, dtype=torch.bool)
    key_mask[0, :4] = False
    got = torch.from_numpy(session.run(None, {"x": x.numpy(), "key_mask": key_mask.numpy()})[0])
    with torch.no_grad():  # the module itself, through PyTorch's padding mask
        want = stack.eval()(x, src_key_padding_mask=~key_mask, is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_save_module_takes_the_module_first_and_warns_on_the_old_order(tmp_path):
    layer = relpos.RelativeTransformerEncoderLayer(16, 2, 32, max_distance=2)
    first = load_module(save_module(layer, tmp_path / "a.pt"))
    with pytest.warns(DeprecationWarning, match="pass the module first"):
        second = load_module(save_module(tmp_path / "b.pt", layer))  # type: ignore[arg-type]
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"needs an nn\.Module first, got str"):
        save_module("x.pt", tmp_path / "c.pt")  # type: ignore[arg-type]
