"""CTranslate2 export: the exported decoder computes what relpos computes (log-probs over the
whole vocabulary at every position, greedy tokens, batch 1 and a ragged batch), and what it
cannot hold exactly is refused in one line. Random small models; nothing downloads."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ctranslate2 = pytest.importorskip("ctranslate2")

from relpos.export import ctranslate2 as ct2  # noqa: E402
from relpos.export.ctranslate2.checking import _relpos_greedy  # noqa: E402
from relpos.models import (  # noqa: E402
    ModelConfig,
    RelativeTransformerEncoderModel,
    RelativeTransformerLM,
)

ATOL = 1e-4
# Prompts longer than 2K + 1 for K = 4 (and past K = 16), of different lengths; the second
# set has a one-token prompt (CTranslate2 then forces every prompt token but the first).
LONG = [list(range(3, 23)), [5, 1, 7], list(range(30, 19, -1))]
WITH_ONE = [[2, 9, 4, 4, 0, 1, 8], [6], [3, 3, 10, 2]]


def _lm(seed: int = 0, vocab_size: int = 37, **kwargs) -> RelativeTransformerLM:
    """A small LM whose weights make varied greedy continuations (at init every model
    repeats its last token: the tied head sees the token's own embedding)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, d_model=32, num_heads=4, num_layers=2)
    model = RelativeTransformerLM(ModelConfig(**{**cfg, **kwargs}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed.weight":
                p.normal_(0.0, 0.05)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
    return model.eval()


def _export(model, tmp_path: Path, name: str = "lm", **kwargs) -> Path:
    return ct2.to_ctranslate2(model, tmp_path / name, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "prompts"),
    [
        (dict(max_distance=0), LONG),
        (dict(max_distance=4), LONG),
        (dict(max_distance=4), WITH_ONE),
        (dict(max_distance=16), LONG),
        (dict(max_distance=4, relative_values=False), WITH_ONE),  # keys only
        (dict(max_distance=4, relative_keys=False), LONG),  # values only
        (dict(positions="learned", max_length=40), LONG),
        (dict(positions="none"), WITH_ONE),
    ],
    ids=["K0", "K4", "K4-one-token-prompt", "K16", "keys-only", "values-only", "learned",
         "no-positions"],
)
def test_float32_export_matches_relpos(tmp_path, kwargs, prompts):
    model = _lm(**kwargs)
    out = _export(model, tmp_path)
    result = ct2.check_ctranslate2(model, out, prompt_ids=prompts, max_new_tokens=10)
    assert [c.name for c in result.cases] == ["batch 1", "ragged batch"]
    assert result.cases[1].lengths == tuple(len(p) for p in prompts)
    assert result.max_logprob_diff <= ATOL, result
    assert result.greedy_match, result
    assert result.ok(ATOL)
    generated = {t for seq in result.cases[1].relpos_tokens for t in seq}
    assert len(generated) >= 3, "greedy continuations too uniform to test anything"


def test_the_check_sees_a_wrong_table(tmp_path):
    """A table changed after the export: the log-probs part (the check has teeth)."""
    model = _lm(max_distance=4)
    out = _export(model, tmp_path)
    with torch.no_grad():
        model.layers[0].self_attn.rel_keys[0] += 1.0  # row of offsets <= -4
    result = ct2.check_ctranslate2(model, out, prompt_ids=LONG, max_new_tokens=2)
    assert result.max_logprob_diff > 1e-2
    assert not result.ok(ATOL)


def test_default_prompts_are_batch_one_and_ragged(tmp_path):
    model = _lm(max_distance=3)
    result = ct2.check_ctranslate2(model, _export(model, tmp_path), max_new_tokens=4)
    assert result.cases[0].lengths == (7,)
    assert len(set(result.cases[1].lengths)) > 1
    assert result.ok(ATOL), result


def test_files_vocabulary_and_special_tokens(tmp_path):
    model = _lm(max_distance=2, vocab_size=11)
    out = _export(model, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.bin", "relpos_ct2.json", "vocabulary.json",
    ]
    tokens = [str(i) for i in range(11)]
    assert ct2.load_vocabulary(out) == tokens
    config = json.loads((out / "config.json").read_text())
    # CTranslate2 would append a missing unk_token (V + 1) and stop at eos: both are token 0.
    assert (config["unk_token"], config["bos_token"], config["eos_token"]) == ("0", "0", "0")
    assert config["layer_norm_epsilon"] == pytest.approx(model.norm.eps)
    meta = ct2.read_metadata(out)
    assert meta["config"] == model.config.to_dict()
    assert meta["vocabulary"] == {"kind": "ids", "size": 11, "file": "vocabulary.json"}
    assert meta["end_token"] == [] and meta["quantization"] is None
    generator = ct2.load_generator(out, intra_threads=1)
    logits = generator.forward_batch([[1, 2, 3]])
    assert tuple(logits.shape) == (1, 3, 11)  # V unchanged


def test_characters_with_whitespace_are_the_vocabulary(tmp_path):
    chars = " \n\tabcdefgh"
    model = _lm(max_distance=2, vocab_size=len(chars))
    out = _export(model, tmp_path, vocabulary=chars)
    assert ct2.load_vocabulary(out) == list(chars)
    assert ct2.read_metadata(out)["vocabulary"]["kind"] == "chars"
    generator = ct2.load_generator(out, intra_threads=1)
    prompts = ["ab c\n", "\t"]
    got = ct2.generate_new_tokens(generator, [list(p) for p in prompts], 6)
    for prompt, new in zip(prompts, got, strict=True):
        ids = [chars.index(c) for c in prompt]
        assert new == list(_relpos_greedy(model, ids, 6))


@pytest.mark.parametrize(("quantization", "bound"),
                         [("int8", 0.5), ("int16", 0.1), ("float16", 0.05), ("bfloat16", 0.2)])
def test_quantized_exports_run_close_and_leave_the_model(tmp_path, quantization, bound):
    model = _lm(max_distance=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = _export(model, tmp_path, quantization=quantization)
    # CTranslate2 quantizes the arrays it is given in place: they must be copies.
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    assert ct2.read_metadata(out)["quantization"] == quantization
    result = ct2.check_ctranslate2(model, out, prompt_ids=LONG, max_new_tokens=2)
    assert result.max_logprob_diff < bound, result


# --- the output directory ----------------------------------------------------------------------


def test_an_existing_directory_is_kept_without_force(tmp_path):
    target = tmp_path / "lm"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists; allowed: a new path, or force=True"):
        _export(_lm(max_distance=2), tmp_path)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    with pytest.raises(FileExistsError, match="is a file"):
        ct2.to_ctranslate2(_lm(max_distance=2), target / "keep.txt")


def test_force_replaces_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "lm"
    target.mkdir()
    (target / "old.txt").write_text("old")
    _export(_lm(max_distance=2), tmp_path, force=True)
    assert not (target / "old.txt").exists() and (target / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm"]


def test_a_failed_write_leaves_the_old_directory(tmp_path, monkeypatch):
    target = tmp_path / "lm"
    target.mkdir()
    (target / "old.txt").write_text("old")

    def broken(self, output_dir):
        Path(output_dir, "model.bin").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(ctranslate2.specs.TransformerDecoderModelSpec, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        _export(_lm(max_distance=2), tmp_path, force=True)
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm"]


def test_a_missing_parent_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ct2.to_ctranslate2(_lm(max_distance=2), tmp_path / "no" / "lm")


# --- refusals ----------------------------------------------------------------------------------


def _with(**kwargs):
    return lambda: RelativeTransformerLM(ModelConfig(vocab_size=13, d_model=16, num_heads=2,
                                                     num_layers=1, **kwargs))


def _post_norm():
    model = _with(max_distance=2)()
    model.layers[0].norm_first = False
    return model


def _relu():
    model = _with(max_distance=2)()
    model.layers[0].activation = F.relu
    return model


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RelativeTransformerEncoderModel(ModelConfig(vocab_size=13, causal=False)),
         r"got a RelativeTransformerEncoderModel; allowed: a RelativeTransformerLM "
         r"\(CTranslate2's encoder model returns hidden states"),
        (_with(num_classes=3), "got a model with num_classes=3; allowed: num_classes=None"),
        (_with(share_heads=False), r"got share_heads=False \(one relative table per head\); "
                                   "allowed: share_heads=True"),
        (_with(max_distance=(3, 1)), r"got the window max_distance=\(3, 1\); allowed: a "
                                     "symmetric clip distance K"),
        (_with(positions="sinusoidal"), "got positions='sinusoidal'; allowed: 'relative', "
                                        "'learned' or 'none'"),
        (_post_norm, r"layer 0 is post-norm \(norm_first=False\); allowed: norm_first=True"),
        (_relu, "layer 0 has the activation .*relu.*; allowed: 'gelu'"),
        (lambda: torch.nn.Linear(2, 2), "got a Linear; allowed: a relpos.models."),
    ],
    ids=["encoder", "num_classes", "per-head", "window", "sinusoidal", "post-norm", "relu",
         "other-module"],
)
def test_refusals_are_one_line(tmp_path, build, message):
    model = build()
    for call in (lambda: ct2.to_ctranslate2(model, tmp_path / "out"),
                 lambda: ct2.check_ctranslate2(model, tmp_path / "out")):
        with pytest.raises(ct2.CTranslate2ExportError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
        assert str(info.value).startswith("cannot export to CTranslate2: ")
    assert not (tmp_path / "out").exists()


def test_bad_arguments(tmp_path):
    model = _with(max_distance=2)()
    with pytest.raises(ct2.CTranslate2ExportError, match="quantization must be None or one of"):
        ct2.to_ctranslate2(model, tmp_path / "a", quantization="int4")
    with pytest.raises(ct2.CTranslate2ExportError, match="has 3 tokens, the model's "
                                                         "vocab_size is 13"):
        ct2.to_ctranslate2(model, tmp_path / "a", vocabulary="abc")
    with pytest.raises(ct2.CTranslate2ExportError, match="the token 'a' twice"):
        ct2.to_ctranslate2(model, tmp_path / "a", vocabulary=["a"] * 13)
    with pytest.raises(TypeError, match=r"model must be a relpos\.models\.RelativeTransformerLM"):
        ct2.to_ctranslate2("model.pt", tmp_path / "a")  # type: ignore[arg-type]
    assert not (tmp_path / "a").exists()


def test_missing_ctranslate2_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import raises ImportError
    with pytest.raises(ct2.CTranslate2MissingError, match=r"pip install 'relpos\[ct2\]'") as e:
        ct2.to_ctranslate2(_with(max_distance=2)(), tmp_path / "a")
    assert isinstance(e.value, ValueError) and isinstance(e.value, ImportError)
    assert not (tmp_path / "a").exists()


def test_a_symmetric_window_checks_like_its_clip_distance(tmp_path):
    """max_distance=(K, K) is stored as [K, K] in the JSON metadata: still this model's."""
    model = _lm(max_distance=(3, 3))
    result = ct2.check_ctranslate2(model, _export(model, tmp_path), prompt_ids=WITH_ONE,
                                   max_new_tokens=4)
    assert result.ok(ATOL), result


def test_check_refuses_another_models_export(tmp_path):
    out = _export(_lm(max_distance=2), tmp_path)
    with pytest.raises(ct2.CTranslate2ExportError, match="another configuration"):
        ct2.check_ctranslate2(_lm(max_distance=3), out)
    with pytest.raises(FileNotFoundError, match=r"no relpos_ct2\.json"):
        ct2.check_ctranslate2(_lm(max_distance=2), tmp_path)
    with pytest.raises(ValueError, match=r"prompt_ids must be in \[0, vocab_size=37\)"):
        ct2.check_ctranslate2(_lm(max_distance=2), out, prompt_ids=[[1, 99]])


# --- relpos.export ---------------------------------------------------------------------------


def test_relpos_export_reexports_without_importing_ctranslate2():
    import relpos.export

    assert relpos.export.to_ctranslate2 is ct2.to_ctranslate2
    assert relpos.export.check_ctranslate2 is ct2.check_ctranslate2
    assert {"to_ctranslate2", "check_ctranslate2"} <= set(relpos.export.__all__)
    # ctranslate2 is imported inside the functions that use it, never at module level.
    src = Path(__file__).resolve().parents[2] / "src" / "relpos"
    for path in sorted((src / "export").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "ctranslate2" for n in names), path
