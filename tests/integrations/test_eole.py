"""relpos.integrations.eole: eole models with Shaw relative positions (small random-weight
models built from eole configs, nothing downloaded) give the same outputs and gradients patched
as unpatched, and decode with eole's own KV cache exactly as their full forward does (which
stock eole does not)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

# eole is in the dev extra: without it these imports fail (the tests never skip silently).
from eole.config.inference import InferenceConfig
from eole.config.models import (
    TransformerEncoderModelConfig,
    TransformerLMModelConfig,
    TransformerModelConfig,
)
from eole.config.run import PredictConfig
from eole.inputters.inputter import dict_to_vocabs
from eole.models.model import BaseModel, get_model_class
from eole.modules.multi_headed_attn import ContextMHA, MultiHeadedAttention, SelfMHA, blhd_to_bld
from eole.modules.relative_position_bias import gen_relative_positions, relative_matmul
from eole.predict import GeneratorLM, GNMTGlobalScorer, Translator
from eole.utils.misc import sequence_mask

import relpos.integrations.eole as rp_eole

# eole's configs call pydantic's deprecated v1 methods on every update.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:eole")

F64 = torch.float64
PAD, BOS, EOS, V = 1, 2, 3, 40
TOKENS = ["<unk>", "<blank>", "<s>", "</s>"] + [f"w{i}" for i in range(V - 4)]


def _vocabs() -> dict:
    return dict_to_vocabs({
        "src": TOKENS, "tgt": TOKENS, "decoder_start_token": "<s>",
        "specials": {"bos_token": "<s>", "pad_token": "<blank>", "eos_token": "</s>",
                     "unk_token": "<unk>"},
    })


def _model(kind: str = "seq2seq", K: int = 2, dtype: torch.dtype = torch.float32, *,
           static: bool = False, position: str = "Relative", seed: int = 0,
           **overrides: object) -> BaseModel:
    """A 2-layer eole model (E = 32, H = 4) built from its config, with random weights."""
    options: dict = dict(
        hidden_size=32, heads=4, transformer_ff=64, layers=2, max_position_embeddings=48,
        embeddings={"word_vec_size": 32, "position_encoding_type": position, "n_positions": K},
    )
    if position == "Rotary":
        options["rope_config"] = {}  # eole's validator fails to default it at model level
    options.update(overrides)
    config_class = {"seq2seq": TransformerModelConfig, "lm": TransformerLMModelConfig,
                    "encoder": TransformerEncoderModelConfig}[kind]
    config = config_class(**options)
    running = InferenceConfig(self_attn_backend="pytorch", dynamic_shapes=not static)
    torch.manual_seed(seed)
    model = get_model_class(config).build(config, _vocabs(), running)
    with torch.no_grad():  # eole builds its linears with skip_init
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        if model.generator is not None:  # logits that vary with the input
            model.generator.weight.normal_(0.0, 1.0)
            model.generator.bias.zero_()
    return model.to(dtype).eval()


def _pair(*args: object, **kwargs: object) -> tuple[BaseModel, BaseModel]:
    stock = _model(*args, **kwargs)  # type: ignore[arg-type]
    patched = copy.deepcopy(stock)
    rp_eole.patch(patched)
    return stock, patched


def _batch(B: int = 3, n: int = 9, seed: int = 1, lengths: tuple[int, ...] = (9, 6, 8),
           first: int | None = None) -> torch.Tensor:
    """``(B, n)`` token ids, right-padded to the given lengths (a ragged batch)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, n), generator=g)
    if first is not None:
        ids[:, 0] = first
    for b, length in enumerate(lengths[:B]):
        ids[b, length:] = PAD
    return ids


def _float64_softmax_attention(self, key, value, query, attn_mask=None, return_attn=False):
    """eole 0.6.4's ``MultiHeadedAttention._compute_attention`` (its manual path, the one it
    takes with relative positions, and for cross-attention on CPU) with the softmax in the
    input dtype instead of float32: the same math as eole's, exact in float64."""
    b, length, h, d = key.size()
    if self.heads_kv < self.heads:
        qh = query.size(2)
        key = key.view(b, length, -1, 1, d).repeat(1, 1, 1, qh // h, 1).view(b, length, qh, d)
        value = value.view(b, length, -1, 1, d).repeat(1, 1, 1, qh // h, 1).view(b, length, qh, d)
    scale = self.dim_per_head**-0.5 if self.scale is None else self.scale
    scores = torch.matmul(query.transpose(1, 2), key.transpose(1, 2).transpose(2, 3)) * scale
    relations = None
    if self.relative_positions_embeddings is not None:
        positions = gen_relative_positions(key.size(1), self.n_positions,
                                           cache=self.kcache is not None)
        relations = self.relative_positions_embeddings(positions)
        scores.add_(relative_matmul(query.transpose(1, 2), relations, True))
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            attn_mask = attn_mask[None, None, :, :]
        attn_mask = attn_mask[..., : scores.size(3)].expand(-1, self.heads, -1, -1)
        scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
    attn = torch.softmax(scores, dim=-1)
    out = torch.matmul(attn, value.transpose(1, 2)).transpose(1, 2)
    if relations is not None:
        out.add_(relative_matmul(attn, relations, False).transpose(1, 2))
    return self.final_linear(blhd_to_bld(out)), attn


@pytest.fixture
def float64_softmax(monkeypatch):
    """Every unpatched eole attention (stock self-attention, and cross-attention in both
    models) computes its softmax in float64."""
    monkeypatch.setattr(MultiHeadedAttention, "_compute_attention", _float64_softmax_attention)


# ----------------------------------------------------------------------------------------------
# What is patched


def test_patch_counts_self_attention_and_leaves_parameters_alone():
    stock = _model("seq2seq")
    patched = copy.deepcopy(stock)
    assert rp_eole.patch(patched) == 4  # 2 encoder + 2 decoder self-attentions
    assert rp_eole.patch(patched) == 4  # again: already patched, counted
    assert rp_eole.is_patched(patched) and not rp_eole.is_patched(stock)
    for m in patched.modules():
        if isinstance(m, ContextMHA):
            assert "forward" not in vars(m) and not rp_eole.is_patched(m)  # cross-attention
        if isinstance(m, SelfMHA):
            assert rp_eole.is_patched(m)
    a, b = stock.state_dict(), patched.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("self_attn.relative_positions_embeddings.weight") for k in b)
    assert rp_eole.patch(_model("lm")) == 2
    assert rp_eole.patch(_model("encoder")) == 2


def test_one_table_per_self_attention_tied_keys_and_values():
    model = _model("seq2seq", K=3)
    tables = [m.relative_positions_embeddings for m in model.modules() if isinstance(m, SelfMHA)]
    assert len(tables) == 4 and len({id(t) for t in tables}) == 4
    assert all(t.weight.shape == (2 * 3 + 1, 8) for t in tables)  # (2K+1, dim_per_head)
    assert all(getattr(m, "relative_positions_embeddings", None) is None
               for m in model.modules() if isinstance(m, ContextMHA))
    names = [n for n, _ in model.named_parameters() if "relative" in n]
    assert len(names) == 4  # one table: the key and the value embedding are the same


def _forwards(model: torch.nn.Module) -> list[object]:
    return [m.forward for m in model.modules()]


@pytest.mark.parametrize("position", ["Rotary", "SinusoidalInterleaved", "Learned", "Alibi"])
def test_other_positions_are_refused_in_one_line_and_nothing_is_patched(position):
    model = _model("seq2seq", position=position)
    before = _forwards(model)
    with pytest.raises(ValueError, match=f"position_encoding_type='{position}'.*allowed: "
                                         "position_encoding_type='Relative'") as err:
        rp_eole.patch(model)
    assert "\n" not in str(err.value)
    assert _forwards(model) == before


def test_t5_buckets_are_refused():
    model = _model("seq2seq", position="Relative", relative_positions_buckets=8)
    with pytest.raises(ValueError, match=r"relative_positions_buckets=8 \(T5"):
        rp_eole.patch(model)


def test_bad_arguments_and_tensor_parallel_are_refused():
    with pytest.raises(TypeError, match=r"expects an eole model.*got str"):
        rp_eole.patch("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Linear has no attention.*no eole SelfMHA"):
        rp_eole.patch(torch.nn.Linear(2, 2))
    model = _model("lm")
    model.decoder.transformer_layers[1].self_attn.parallel_gpu = 2
    before = _forwards(model)
    with pytest.raises(ValueError, match=r"parallel_gpu=2.*allowed: parallel_gpu=1.*nothing"):
        rp_eole.patch(model)
    assert _forwards(model) == before


def test_patch_on_build_patches_the_models_eole_builds(monkeypatch):
    monkeypatch.setattr(BaseModel, "build", BaseModel.__dict__["build"])  # restored afterwards
    rp_eole.patch_on_build()
    rp_eole.patch_on_build()  # once is enough
    assert rp_eole.is_patched(_model("seq2seq"))
    assert not rp_eole.is_patched(_model("seq2seq", position="Rotary"))  # built as before


def _call(f, x):
    """eole's ``maybe_ckpt`` without checkpointing, as a function pickle can name."""
    return f(x)


def test_torch_save_and_load_keep_the_patch(tmp_path):
    """A patched model pickles and loads back patched, with the same numbers. Stock eole 0.6.4
    models do not pickle at all (each attention and MLP holds a lambda, ``maybe_ckpt``): those
    are replaced by a named function first, so that only relpos's part is tested."""
    stock, patched = _pair("seq2seq", 3)
    for m in patched.modules():
        if "maybe_ckpt" in vars(m):
            m.maybe_ckpt = _call
    src, tgt = _seq2seq_inputs()
    with torch.no_grad():
        before = patched(src, tgt, None).dec_out
    torch.save(patched, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    attention = loaded.encoder.transformer_layers[0].self_attn
    assert rp_eole.is_patched(attention) and attention.forward.func is rp_eole._relpos_forward
    with torch.no_grad():
        after = loaded(src, tgt, None).dec_out
        torch.testing.assert_close(after, before, rtol=0, atol=0)
        torch.testing.assert_close(after, stock(src, tgt, None).dec_out, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Forward and backward: eole's numbers


def _seq2seq_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    src = _batch(3, 9, seed=1, lengths=(9, 6, 8))
    tgt = _batch(3, 8, seed=2, lengths=(8, 5, 7), first=BOS)
    return src, tgt


@pytest.mark.parametrize("K", [2, 20])
@pytest.mark.parametrize("overrides", [{}, {"heads_kv": 2}], ids=["mha", "gqa"])
def test_encoder_decoder_outputs_equal_float32(K, overrides):
    stock, patched = _pair("seq2seq", K, **overrides)
    src, tgt = _seq2seq_inputs()
    pad = src.eq(PAD).unsqueeze(1)
    with torch.no_grad():
        enc_s, _ = stock.encoder(stock.src_emb(src), pad_mask=pad)
        enc_p, _ = patched.encoder(patched.src_emb(src), pad_mask=pad)
        torch.testing.assert_close(enc_p, enc_s, rtol=0, atol=1e-5)
        torch.testing.assert_close(patched(src, tgt, None).dec_out,
                                   stock(src, tgt, None).dec_out, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["seq2seq", "lm", "encoder"])
def test_outputs_equal_float64(kind, float64_softmax):
    stock, patched = _pair(kind, 3, F64)
    src, tgt = _seq2seq_inputs()
    with torch.no_grad():
        want, got = stock(src, tgt, None).dec_out, patched(src, tgt, None).dec_out
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def _masked_loss(model: BaseModel, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    out = model(src, tgt, None).dec_out
    gold = tgt[:, 1:] if model.tgt_shift else src
    logits = model.generator(out)  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), gold, ignore_index=PAD)


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (F64, 1e-9)])
def test_teacher_forced_logits_and_gradients_equal(kind, dtype, tol, monkeypatch):
    if dtype == F64:
        monkeypatch.setattr(MultiHeadedAttention, "_compute_attention",
                            _float64_softmax_attention)
    stock, patched = _pair(kind, 2, dtype)
    stock.train()
    patched.train()
    src, tgt = _seq2seq_inputs()
    with torch.no_grad():
        torch.testing.assert_close(patched.generator(patched(src, tgt, None).dec_out),
                                   stock.generator(stock(src, tgt, None).dec_out),
                                   rtol=0, atol=tol * 10)
    grads = []
    for model in (stock, patched):
        model.zero_grad()
        _masked_loss(model, src, tgt).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=tol, msg=name)
    table = "decoder.transformer_layers.0.self_attn.relative_positions_embeddings.weight"
    assert grads[1][table].abs().sum() > 0


def test_left_padded_batch_equal_at_real_tokens():
    stock, patched = _pair("lm", 2)
    ids = _batch(3, 9, seed=3, lengths=(9, 9, 9))
    ids[1, :3] = PAD  # left padding: these rows see no key
    ids[2, :1] = PAD
    with torch.no_grad():
        want, got = stock(ids, None, None).dec_out, patched(ids, None, None).dec_out
    real = ids.ne(PAD)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)


def test_training_batches_go_to_relpos_as_key_masks(monkeypatch):
    """eole's (B, 1, L, S) causal-and-padding masks reach relpos as a (B, S) key mask with
    is_causal (the flash_regions backend's O(n) form), not as dense masks."""
    _, patched = _pair("seq2seq", 2)
    seen: list[dict] = []
    real = rp_eole.relative_attention

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(rp_eole, "relative_attention", spy)
    src, tgt = _seq2seq_inputs()
    with torch.no_grad():
        patched(src, tgt, None)
    assert len(seen) == 4 and all(kw["attn_mask"] is None for kw in seen)
    assert [kw["is_causal"] for kw in seen] == [False, False, True, True]
    assert all(kw["key_mask"].shape == (3, 9 if not kw["is_causal"] else 7) for kw in seen)


def test_long_document_runs_through_the_native_kernels():
    import relpos

    stock, patched = _pair("lm", 4)
    ids = torch.randint(4, V, (1, 600), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids, None, None).dec_out,
                                   stock(ids, None, None).dec_out, rtol=0, atol=1e-5)
    q = torch.randn(1, 4, 600, 8)
    table = torch.randn(9, 8)
    assert relpos.select_backend(q, q, q, max_distance=4, rel_keys=table, rel_values=table,
                                 is_causal=True) == "native"


def test_attention_weights_when_asked():
    stock, patched = _pair("lm", 2)
    ids = _batch(3, 9, seed=5, lengths=(9, 7, 8))
    with torch.no_grad():
        want = stock(ids, None, None, return_attn=True).attns["std"]
        got = patched(ids, None, None, return_attn=True).attns["std"]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_dropout_in_training_runs():
    model = _model("seq2seq", 2)
    rp_eole.patch(model)
    for m in model.modules():
        if isinstance(m, SelfMHA):
            m.update_dropout(0.5)
    model.train()
    src, tgt = _seq2seq_inputs()
    torch.manual_seed(0)
    a = model(src, tgt, None).dec_out
    torch.manual_seed(1)
    b = model(src, tgt, None).dec_out
    assert not torch.allclose(a, b)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt, None).dec_out, model(src, tgt, None).dec_out)


# ----------------------------------------------------------------------------------------------
# Cached decoding through eole's own cache


def _encode(model: BaseModel, src: torch.Tensor):
    enc_out, _ = model.encoder(model.src_emb(src), pad_mask=src.eq(PAD).unsqueeze(1))
    src_pad_mask = sequence_mask(src.ne(PAD).sum(1), src.size(1)).unsqueeze(1)
    return enc_out, src_pad_mask


def _cached_steps(model: BaseModel, tgt: torch.Tensor, src: torch.Tensor | None = None,
                  prefill: int = 1) -> torch.Tensor:
    """Decoder outputs through eole's KV cache, as its Translator / GeneratorLM drive it: the
    first ``prefill`` tokens in one call, then one token a step, ``_extend_cache`` after each.
    """
    dec = model.decoder
    enc_out, src_pad_mask = _encode(model, src) if src is not None else (None, None)
    outs = []
    with torch.no_grad():
        t = 0
        while t < tgt.size(1):
            n = prefill if t == 0 else 1
            inp = tgt[:, t : t + n]
            emb = model.tgt_emb(inp, step=t)
            pad_mask = inp.eq(PAD).unsqueeze(1)
            if t == 0:
                dec._init_cache(emb, pad_mask, enc_out=enc_out)
            else:
                pad_mask = torch.zeros_like(pad_mask)
            kw = {} if src is None else dict(enc_out=enc_out, src_pad_mask=src_pad_mask)
            out, _ = dec(emb, step=t, tgt_pad_mask=pad_mask, **kw)
            outs.append(out)
            dec._extend_cache()
            t += n
        dec._disable_cache()
    return torch.cat(outs, 1)


def _full(model: BaseModel, tgt: torch.Tensor, src: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        if src is None:
            return model(tgt, None, None).dec_out
        return model(src, torch.cat([tgt, tgt[:, :1]], 1), None).dec_out


@pytest.mark.parametrize("K", [2, 4, 20])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_cached_steps_equal_the_full_forward(kind, static, K):
    stock, patched = _pair(kind, K, static=static)
    src = _batch(3, 9, seed=1) if kind == "seq2seq" else None
    tgt = _batch(3, 40, seed=6, lengths=(40,) * 3, first=BOS)  # beyond one 32-slot extension
    got = _cached_steps(patched, tgt, src)
    torch.testing.assert_close(got, _full(patched, tgt, src), rtol=0, atol=2e-5)
    torch.testing.assert_close(got, _full(stock, tgt, src), rtol=0, atol=2e-5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_prompt_prefill_then_steps_equal_the_full_forward(static):
    _, patched = _pair("lm", 3, F64, static=static)
    tokens = _batch(2, 20, seed=7, lengths=(20, 20))
    got = _cached_steps(patched, tokens, prefill=9)
    torch.testing.assert_close(got, _full(patched, tokens), rtol=0, atol=1e-10)


def test_chunked_prefill_equals_the_full_forward():
    _, patched = _pair("lm", 3, F64)
    patched.decoder.prefill_chunk_size = 4
    tokens = _batch(2, 15, seed=8, lengths=(15, 15))
    got = _cached_steps(patched, tokens, prefill=11)  # chunks of 4, 4, 3
    torch.testing.assert_close(got, _full(patched, tokens), rtol=0, atol=1e-10)


def test_cached_attention_weights_have_eole_shape():
    stock, patched = _pair("lm", 2)
    tokens = _batch(2, 5, seed=9, lengths=(5, 5))
    dec = patched.decoder
    with torch.no_grad():
        emb = patched.tgt_emb(tokens, step=0)
        dec._init_cache(emb, tokens.eq(PAD).unsqueeze(1))
        _, attns = dec(emb, step=0, tgt_pad_mask=tokens.eq(PAD).unsqueeze(1), return_attn=True)
        dec._disable_cache()
        want = stock(tokens, None, None, return_attn=True).attns["std"]
    torch.testing.assert_close(attns["std"], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("K", [2, 4, 20])
@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_stock_eole_cached_decoding_is_wrong(kind, K):
    """Stock eole 0.6.4 places a cached step's query at the end of the cache buffer: from the
    second step with its dynamic cache (which grows by 32 slots), from the first with a static
    one, and a prefill through the cache gives every query the last one's offsets."""
    src = _batch(3, 9, seed=1) if kind == "seq2seq" else None
    tgt = _batch(3, 12, seed=6, lengths=(12,) * 3, first=BOS)
    dynamic = _model(kind, K)
    err = (_cached_steps(dynamic, tgt, src) - _full(dynamic, tgt, src)).abs().amax(dim=(0, 2))
    assert err[0] < 1e-5 and (err[1:] > 0.01).all(), err
    static = _model(kind, K, static=True)
    err = (_cached_steps(static, tgt, src) - _full(static, tgt, src)).abs().amax(dim=(0, 2))
    assert (err > 0.01).all(), err
    if kind == "lm":
        err = (_cached_steps(dynamic, tgt, prefill=6) - _full(dynamic, tgt)).abs()
        assert err[:, 1:6].amax() > 0.05  # the prefill's queries but its last


def test_a_cache_grown_one_slot_a_step_is_right_in_stock_eole():
    """What pins the cause: with the buffer exactly as long as the tokens written, stock eole's
    offsets are right."""
    stock = _model("lm", 2)
    tgt = _batch(2, 10, seed=6, lengths=(10, 10), first=BOS)
    original = stock.decoder._extend_cache
    stock.decoder._extend_cache = lambda threshold=1, addzeros=32: original(threshold, 1)
    torch.testing.assert_close(_cached_steps(stock, tgt), _full(stock, tgt), rtol=0, atol=2e-5)


def test_rotary_models_decode_correctly_in_stock_eole():
    stock = _model("lm", position="Rotary")
    tgt = _batch(2, 12, seed=6, lengths=(12, 12), first=BOS)
    torch.testing.assert_close(_cached_steps(stock, tgt), _full(stock, tgt), rtol=0, atol=2e-5)


# ----------------------------------------------------------------------------------------------
# eole's Translator and GeneratorLM


def _predictor(model: BaseModel, tmp_path, monkeypatch, *, beam: int = 1, static: bool = False,
               max_length: int = 12):
    """eole's own predictor for ``model`` (``Translator`` or ``GeneratorLM``). Greedy (beam 1)
    runs ``max_length`` steps (no end of sentence before), so batch rows keep their order."""
    monkeypatch.setenv("MODEL_PATH", str(tmp_path))  # eole's config sets it; restored after
    options: dict = dict(
        model_path=str(tmp_path), src="unused", beam_size=beam, n_best=beam,
        max_length=max_length, max_length_ratio=0, length_penalty="none", alpha=0.0, seed=1,
        dynamic_shapes=not static, self_attn_backend="pytorch")
    if beam == 1:
        options.update(top_k=1, min_length=max_length)  # greedy
    config = PredictConfig(**options)
    cls = Translator if model.encoder is not None else GeneratorLM
    model_config = types.SimpleNamespace(add_estimator=False, estimator_type="average",
                                         encoder=model.encoder)
    return cls(model, _vocabs(), config, model_config=model_config, device_id=-1,
               global_scorer=GNMTGlobalScorer.from_config(config), report_score=False)


def _predict(predictor, batch: dict) -> tuple[list[list[list[int]]], torch.Tensor, dict]:
    """``(predictions, log-probabilities of every step (B·beam, T, V), results)``."""
    steps: list[torch.Tensor] = []
    real = predictor._decode_and_generate

    def record(*args, **kwargs):
        out = real(*args, **kwargs)
        steps.append(out[0].clone())  # before the search edits them
        return out

    predictor._decode_and_generate = record
    results = predictor.predict_batch(batch, attn_debug=False)
    predictions = [[[int(t) for t in hyp] for hyp in sent] for sent in results["predictions"]]
    return predictions, torch.stack(steps, 1), results


def _full_logprobs(model: BaseModel, src: torch.Tensor | None, prefix: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probabilities of the tokens after ``prefix``, by the full forward:
    ``(B, T, V)``, row t predicting ``tokens[:, t]``."""
    P, T = prefix.size(1), tokens.size(1)
    seq = torch.cat([prefix, tokens], 1)
    with torch.no_grad():
        if src is not None:  # the decoder reads all but the last token: add one
            out = model(src, torch.cat([seq, seq[:, :1]], 1), None).dec_out
        else:
            out = model(seq, None, None).dec_out
        logits = model.generator(out[:, P - 1 : P - 1 + T])
    return torch.log_softmax(logits.float(), -1)


def _no_cache_greedy(model: BaseModel, src: torch.Tensor | None, prefix: torch.Tensor,
                     steps: int) -> torch.Tensor:
    """Greedy decoding (no end of sentence) by the full forward over the whole prefix at every
    step: ``(B, steps)``."""
    tokens = prefix[:, :0]
    for _ in range(steps):
        dummy = prefix[:, :1]  # stands for the token being predicted
        logp = _full_logprobs(model, src, prefix, torch.cat([tokens, dummy], 1))[:, -1]
        logp[:, EOS] = -float("inf")
        tokens = torch.cat([tokens, logp.argmax(-1, keepdim=True)], 1)
    return tokens


def _bos(B: int) -> torch.Tensor:
    return torch.full((B, 1), BOS)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_translator_greedy_equals_no_cache_greedy(static, tmp_path, monkeypatch):
    stock, patched = _pair("seq2seq", 2, static=static)
    src = _batch(3, 9, seed=11)
    batch = {"src": src, "srclen": src.ne(PAD).sum(1)}
    got, logp, _ = _predict(_predictor(patched, tmp_path, monkeypatch, static=static), batch)
    want = _no_cache_greedy(patched, src, _bos(3), 12)
    assert [g[0] for g in got] == want.tolist()
    torch.testing.assert_close(logp, _full_logprobs(patched, src, _bos(3), want),
                               rtol=0, atol=1e-4)
    # Stock eole: its cached log-probabilities are not its model's.
    got, logp, _ = _predict(_predictor(stock, tmp_path, monkeypatch, static=static), batch)
    tokens = torch.tensor([g[0] for g in got])
    assert (logp - _full_logprobs(stock, src, _bos(3), tokens)).abs().max() > 0.5


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_translator_beam_search_is_consistent(static, tmp_path, monkeypatch):
    """Beam 4 through the patched cache: every hypothesis' score is its teacher-forced
    log-probability, and the best is at least the greedy translation's."""
    _, patched = _pair("seq2seq", 2, static=static)
    src = _batch(2, 9, seed=12, lengths=(9, 7))
    batch = {"src": src, "srclen": src.ne(PAD).sum(1)}
    hyps, _, results = _predict(_predictor(patched, tmp_path, monkeypatch, beam=4, max_length=8,
                                           static=static), batch)
    for b in range(2):
        assert len(hyps[b]) == 4
        for hyp, score in zip(hyps[b], results["scores"][b], strict=True):
            tokens = torch.tensor([hyp])
            full = _full_logprobs(patched, src[b : b + 1], _bos(1), tokens)
            assert abs(float(full.gather(2, tokens[..., None]).sum()) - float(score)) < 1e-3
    greedy, _, _ = _predict(_predictor(patched, tmp_path, monkeypatch, beam=1, max_length=8,
                                       static=static), batch)
    for b in range(2):
        tokens = torch.tensor([greedy[b][0]])
        full = _full_logprobs(patched, src[b : b + 1], _bos(1), tokens)
        greedy_score = float(full.gather(2, tokens[..., None]).sum())
        assert max(float(s) for s in results["scores"][b]) >= greedy_score - 1e-4


@pytest.mark.parametrize("left_pad", [True, False])
def test_generator_lm_greedy_equals_no_cache_greedy(left_pad, tmp_path, monkeypatch):
    stock, patched = _pair("lm", 2)
    src = _batch(2, 7, seed=13, lengths=(7, 7))
    if left_pad:  # a ragged batch, prefilled with left padding
        src[1] = torch.cat([torch.full((2,), PAD), src[1, :5]])
    batch = {"src": src, "srclen": src.ne(PAD).sum(1), "left_pad": left_pad}
    got, logp, _ = _predict(_predictor(patched, tmp_path, monkeypatch, max_length=10), batch)
    want = _no_cache_greedy(patched, None, src, 10)
    assert [g[0] for g in got] == want.tolist()
    torch.testing.assert_close(logp, _full_logprobs(patched, None, src, want), rtol=0, atol=1e-4)
    got, logp, _ = _predict(_predictor(stock, tmp_path, monkeypatch, max_length=10), batch)
    tokens = torch.tensor([g[0] for g in got])
    assert (logp - _full_logprobs(stock, None, src, tokens)).abs().max() > 0.1


def test_ctranslate2_serves_the_checkpoint_as_before(tmp_path, monkeypatch):
    """A patched model's checkpoint is eole's own: CTranslate2's eole converter reads it, and
    CTranslate2 gives the patched model's teacher-forced log-probabilities and greedy tokens."""
    import json

    import ctranslate2
    from ctranslate2.converters.eole_ct2 import EoleConverter
    from eole.config import recursive_model_fields_set
    from eole.inputters.inputter import vocabs_to_dict
    from safetensors.torch import save_file

    _, patched = _pair("seq2seq", 2)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = TransformerModelConfig(
        hidden_size=32, heads=4, transformer_ff=64, layers=2, max_position_embeddings=48,
        embeddings={"word_vec_size": 32, "position_encoding_type": "Relative", "n_positions": 2})
    (model_dir / "config.json").write_text(json.dumps(
        {"model": recursive_model_fields_set(config), "data": {}, "src_vocab": "unused",
         "share_vocab": True}))
    (model_dir / "vocab.json").write_text(json.dumps(vocabs_to_dict(_vocabs())))
    save_file({k: v.contiguous() for k, v in patched.state_dict().items()},
              str(model_dir / "model.00.safetensors"))
    monkeypatch.setenv("MODEL_PATH", str(model_dir))  # eole's loader sets it; restored after
    EoleConverter(str(model_dir)).convert(str(tmp_path / "ct2"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"))

    src = _batch(3, 9, seed=11)
    words = [[TOKENS[i] for i in row if i != PAD] for row in src.tolist()]
    tgt = torch.cat([_batch(3, 8, seed=21, lengths=(8, 8, 8)), torch.full((3, 1), EOS)], 1)
    scored = translator.score_batch(words, [[TOKENS[i] for i in row[:-1]] for row in tgt.tolist()])
    want = _full_logprobs(patched, src, _bos(3), tgt).gather(2, tgt[..., None])[..., 0]
    torch.testing.assert_close(torch.tensor([r.log_probs for r in scored]), want,
                               rtol=0, atol=1e-4)
    greedy = translator.translate_batch(words, beam_size=1, max_decoding_length=12,
                                        min_decoding_length=12)
    got = [[TOKENS.index(t) for t in r.hypotheses[0]] for r in greedy]
    assert got == _no_cache_greedy(patched, src, _bos(3), 12).tolist()
