"""The fast decode step (StepDecoder) and generate(): exact against the modules and the
full forward in float64, few ops a step, and what users expect of generate()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import DECODING_CONFIGS, random_lm
from relpos import KVCache
from relpos.models import ModelConfig, RelativeTransformerLM
from relpos.models.decoding import StepDecoder

V = 23

CONFIGS = DECODING_CONFIGS


def _lm(**kw: object) -> RelativeTransformerLM:
    return random_lm(**kw)


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_steps_equal_full_forward_and_module_steps(kw: dict) -> None:
    model = _lm(**kw)
    B, P, T = 3, 5, 9
    ids = torch.randint(0, V, (B, P + T))
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[1, :2] = False  # a left-padded prompt
    full_mask = torch.cat([prompt_mask, torch.ones(B, T, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        full = model(ids, key_mask=full_mask)
        fast, slow = model.new_cache(capacity=P + T, growable=False), model.new_cache()
        model(ids[:, :P], key_mask=prompt_mask, cache=fast)
        model(ids[:, :P], key_mask=prompt_mask, cache=slow)
        step = StepDecoder(model)
        step.start(fast)
        for t in range(P, P + T):
            a = step(ids[:, t], fast)
            b = model(ids[:, t : t + 1], cache=slow)[:, 0]
            torch.testing.assert_close(a, full[:, t], rtol=0, atol=1e-11)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    assert fast.length == slow.length == P + T
    for lf, ls in zip(fast, slow, strict=True):  # the raw cache is the modules' cache
        torch.testing.assert_close(lf.keys, ls.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(lf.values, ls.values, rtol=0, atol=1e-12)


def test_prompt_of_one_token_then_growing_band() -> None:
    model = _lm(max_distance=6)
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(capacity=12, growable=False)
        model(ids[:, :1], cache=cache)
        step = StepDecoder(model)
        step.start(cache)
        for t in range(1, 12):
            torch.testing.assert_close(step(ids[:, t], cache), full[:, t], rtol=0, atol=1e-11)


_VIEWS = {"view", "slice", "select", "t", "unsqueeze", "transpose", "expand", "as_strided",
          "alias", "permute", "reshape", "_unsafe_view"}


class _CountOps(TorchDispatchMode):
    """Counts ATen calls, and separately those that compute (not views)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        self.compute += func.__name__.split(".")[0] not in _VIEWS
        return func(*args, **(kwargs or {}))


def test_a_step_issues_few_aten_ops_per_layer() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=32, num_heads=4, num_layers=4, max_distance=3)
    model = RelativeTransformerLM(cfg).eval()
    ids = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        cache = model.new_cache(capacity=12, growable=False)
        model(ids, cache=cache)
        step = StepDecoder(model)
        step.start(cache)
        with _CountOps() as fast:
            step(ids[:, 0], cache)
        with _CountOps() as slow:
            model(ids[:, :1], cache=model_cache(model, ids))
    layers = cfg.num_layers
    # per layer: 2 norms, 4 linears, 2 cache writes, 2 band updates, 1 attention, 3 adds
    assert fast.compute <= 15 * layers + 6, f"{fast.compute} computing ATen ops, {layers} layers"
    assert fast.count <= 45 * layers, f"{fast.count} ATen ops for {layers} layers"
    assert fast.count * 2 < slow.count, (fast.count, slow.count)


def model_cache(model: RelativeTransformerLM, ids: torch.Tensor) -> KVCache:
    cache = model.new_cache()
    model(ids, cache=cache)
    return cache


def test_reserve_step_refusals() -> None:
    model = _lm(max_distance=2)
    cache = model.new_cache(capacity=3, growable=False)
    step = StepDecoder(model)
    with pytest.raises(ValueError, match="prefill"):
        step.start(cache)
    with pytest.raises(ValueError, match="filled cache"):
        cache[0].reserve_step(1, 3, 8)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"\(B, H, D\)"):
        cache[0].reserve_step(2, 3, 8)
    with pytest.raises(ValueError, match="capacity"):
        cache[0].reserve_step(1, 3, 8)  # full, fixed size
    with pytest.raises(ValueError, match="advance"):
        cache.advance(1)
    with pytest.raises(TypeError, match="RelativeTransformerLM"):
        StepDecoder(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kw", [dict(max_distance=3),
                                dict(max_distance=(2, 1), share_heads=False)], ids=str)
def test_steps_follow_a_cache_that_grows_shrinks_is_reordered_or_reset(kw: dict) -> None:
    """The decoder's own storages (keys and values plus their table row) stay in sync with
    every change of the cache: each step equals the full forward of the sequence so far."""
    model = _lm(**kw)
    ids = torch.randint(0, V, (3, 30), generator=torch.Generator().manual_seed(1))
    step = StepDecoder(model)

    def check(cache: KVCache, seq: torch.Tensor, upto: int) -> torch.Tensor:
        """Steps ``cache`` (holding ``seq[:, :cache.length]``) up to ``upto`` tokens."""
        for t in range(cache.length, upto):
            got = step(seq[:, t], cache)
            torch.testing.assert_close(got, model(seq[:, : t + 1])[:, -1], rtol=0, atol=1e-10)
        return seq

    with torch.no_grad():
        cache = model.new_cache(capacity=4)  # growable, smaller than the sequence
        model(ids[:, :3], cache=cache)
        step.start(cache)
        check(cache, ids, 20)  # grows 4 -> 8 -> 16 -> 32 under the steps
        assert cache.capacity >= 20
        cache.truncate(11)  # shrink (e.g. rejected speculative tokens), then go on
        other = ids.clone()
        other[:, 11:] = ids.flip(1)[:, 11:]
        check(cache, other, 16)
        model(other[:, 16:19], cache=cache)  # a chunk appended through the model
        check(cache, other, 22)
        order = torch.tensor([2, 0, 0, 1])  # reorder, a row repeated: the batch size changes
        cache.reorder(order)
        check(cache, other[order], 26)
        cache.reset()  # a new prompt in the same cache
        model(ids[:2, :5], cache=cache)
        check(cache, ids[:2], 9)
        fixed = model.new_cache(capacity=12, growable=False)  # another cache, same decoder
        model(ids[:, :2], cache=fixed)
        check(fixed, ids, 12)


# ----------------------------------------------------------------------------- generate
def test_generate_greedy_matches_module_decoding() -> None:
    model = _lm(max_distance=3)
    prompt = torch.randint(0, V, (2, 4))
    out = model.generate(prompt, 10, temperature=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(10):  # greedy through full forwards
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)
    assert torch.equal(model.generate(prompt, 10, temperature=0, new_tokens_only=True), ids[:, 4:])
    assert model.generate(prompt, 0, new_tokens_only=True).shape == (2, 0)


def test_generate_stops_at_eos_and_pads_finished_rows() -> None:
    model = _lm(max_distance=3)
    prompt = torch.randint(0, V, (3, 4))
    free = model.generate(prompt, 12, temperature=0, new_tokens_only=True)
    eos = int(free[0, 2])  # row 0 emits it at step 2
    out = model.generate(prompt, 12, temperature=0, eos_token_id=eos, pad_token_id=0,
                         new_tokens_only=True)
    for row in range(3):
        hits = (free[row] == eos).nonzero()
        if len(hits):
            first = int(hits[0])
            assert torch.equal(out[row, : first + 1], free[row, : first + 1])
            assert bool((out[row, first + 1 :] == 0).all())
        else:
            assert torch.equal(out[row], free[row, : out.shape[1]])
    finished = [(free[r] == eos).nonzero() for r in range(3)]
    if all(len(f) for f in finished):  # everyone stopped: no step past the last stop
        assert out.shape[1] == max(int(f[0]) for f in finished) + 1
    # a list of stop tokens; pad defaults to the first
    both = model.generate(prompt, 12, temperature=0, eos_token_id=[eos, int(free[1, 0])],
                          new_tokens_only=True)
    assert both.shape[1] <= out.shape[1]
    assert int(both[1, 0]) == int(free[1, 0])
    assert bool((both[1, 1:] == eos).all())


@pytest.mark.parametrize("sampling", [
    dict(temperature=1e-40), dict(temperature=1e-300), dict(temperature=5e-324),
    dict(top_p=1e-320), dict(top_p=5e-324), dict(top_p=1e-40, temperature=1e-300),
], ids=str)
def test_a_tiny_temperature_or_top_p_is_greedy(sampling: dict) -> None:
    """The temperature divides logits with the top one at 0 (in float64); the top token
    always stays in the nucleus."""
    model = _lm(max_distance=3)
    prompt = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 6, generator=torch.Generator().manual_seed(0), **sampling)
    assert torch.equal(out, model.generate(prompt, 6, temperature=0))


def test_generate_refuses_a_cache_larger_than_memory() -> None:
    model = _lm(max_distance=3)
    with pytest.raises(ValueError, match=r"max_new_tokens=1000000000000: a cache of 4 \+ "
                                         r"1000000000000 positions needs .* GiB, more than"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 10**12)


def test_generate_top_p() -> None:
    model = _lm(max_distance=3)
    prompt = torch.randint(0, V, (4, 3))
    tiny = model.generate(prompt, 8, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny, model.generate(prompt, 8, temperature=0))  # only the top token
    a = model.generate(prompt, 8, top_p=1.0, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    out = model.generate(prompt, 8, top_p=0.5, temperature=1.0,
                         generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        probs = model(out[:, :-1])[:, 2:].softmax(-1)  # (B, 8, V)
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above
    chosen = (order == out[:, 3:, None]).float().argmax(-1, keepdim=True)
    assert bool((before.gather(-1, chosen) < 0.5 + 1e-9).all())  # inside the nucleus


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p="0.5"), TypeError, "top_p"),
        (dict(eos_token_id=V), ValueError, "eos_token_id"),
        (dict(eos_token_id=[]), TypeError, "eos_token_id"),
        (dict(eos_token_id=1.0), TypeError, "eos_token_id"),
        (dict(pad_token_id=[1]), TypeError, "pad_token_id"),
        (dict(pad_token_id=-1), ValueError, "pad_token_id"),
        (dict(new_tokens_only=1), TypeError, "new_tokens_only"),
    ],
)
def test_generate_refuses_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _lm(max_distance=2).generate(torch.zeros(1, 2, dtype=torch.long), 3, **kwargs)


# ----------------------------------------------------------------------------- float32 layouts
@pytest.mark.parametrize("batch", [1, 3])
def test_fast_linear_layouts_match_f_linear_in_float32(batch: int) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=32, num_heads=4, num_layers=2, max_distance=3)
    model = RelativeTransformerLM(cfg).eval()
    ids = torch.randint(0, V, (batch, 12))
    outs = []
    for fast in (True, False):
        with torch.no_grad():
            cache = model.new_cache(capacity=12, growable=False)
            model(ids[:, :4], cache=cache)
            step = StepDecoder(model, fast_linears=fast)
            step.start(cache)
            outs.append(torch.stack([step(ids[:, t], cache) for t in range(4, 12)], 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(outs[0], model(ids)[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packing", ["relpos", "onednn", "mkl", "none"])
@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5), (40, 24)])
def test_fast_layouts_follow_in_place_weight_changes(
        packing: str, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layout (wide and tall weights at batch 1, each library's packing above it) equals
    F.linear, and is rebuilt after the weight changes in place or the packing changes."""
    from relpos.models.decoding import decode_linear

    monkeypatch.setenv("RELPOS_DECODE_PACKING", packing)
    w, b = torch.randn(*shape), torch.randn(shape[0])
    x = torch.randn(2, shape[1])
    for batch in (1, 2, 8):
        x = torch.randn(batch, 4)
        x = torch.randn(batch, shape[1])
        torch.testing.assert_close(decode_linear(w, b, batch)(x), F.linear(x, w, b))
        torch.testing.assert_close(decode_linear(w, None, batch)(x), F.linear(x, w))
        strided = torch.randn(batch, 2 * shape[1])[:, ::2]  # rows not contiguous
        torch.testing.assert_close(decode_linear(w, b, batch)(strided), F.linear(strided, w, b))
        with torch.no_grad():
            w.mul_(-2.0)  # an optimizer step, say: the cached layout is stale
        torch.testing.assert_close(decode_linear(w, b, batch)(x), F.linear(x, w, b))
    other = "relpos" if packing == "onednn" else "onednn"
    monkeypatch.setenv("RELPOS_DECODE_PACKING", other)  # the cached packing is the other's
    torch.testing.assert_close(decode_linear(w, b, 8)(x), F.linear(x, w, b))
    wd = w.double()
    assert decode_linear(wd, None, 2)(x[:2].double()).dtype == torch.float64


class _Kernels:
    """A stand-in for the native kernels' module: the decode ops and a build_info."""

    panel_linear = pack_panels = decode_attention = staticmethod(lambda *args: None)

    def __init__(self, vectors: str | None) -> None:
        self.info = "blas=mkl amx=none" + (f" vectors={vectors}" if vectors else "")

    def build_info(self) -> str:
        return self.info


def test_decode_packing_default_follows_the_cpu_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    from relpos.models import decoding
    from relpos.ops.native import build

    monkeypatch.delenv("RELPOS_DECODE_PACKING", raising=False)
    monkeypatch.setattr(decoding, "_mkl_packing", lambda: True)
    monkeypatch.setattr(decoding, "_onednn_packing", lambda: True)
    amd = {"vendor_id": "AuthenticAMD"}
    for vectors in ("avx512", "avx2"):
        monkeypatch.setattr(build, "load", lambda quiet=False, v=vectors: _Kernels(v))
        for vendor, packing in (("GenuineIntel", "mkl"), ("AuthenticAMD", "relpos"),
                                ("", "relpos")):
            monkeypatch.setattr(decoding, "cpuinfo", lambda v=vendor: {"vendor_id": v})
            assert decoding.decode_packing() == packing
    monkeypatch.setattr(decoding, "cpuinfo", lambda: amd)
    monkeypatch.setenv("RELPOS_DECODE_PACKING", "relpos")  # asked for on any CPU
    assert decoding.decode_packing() == "relpos"
    for vectors in ("none", None):  # kernels built without their vector code: plain loops
        monkeypatch.setattr(build, "load", lambda quiet=False, v=vectors: _Kernels(v))
        monkeypatch.delenv("RELPOS_DECODE_PACKING")
        assert decoding.decode_packing() == "onednn"
        monkeypatch.setenv("RELPOS_DECODE_PACKING", "relpos")  # asked for: served
        assert decoding.decode_packing() == "relpos"
    monkeypatch.delenv("RELPOS_DECODE_PACKING")
    monkeypatch.setattr(build, "load", lambda quiet=False: None)  # no native kernels
    assert decoding.decode_packing() == "onednn"
    monkeypatch.setenv("RELPOS_DECODE_PACKING", "relpos")
    assert decoding.decode_packing() == "none"
    monkeypatch.delenv("RELPOS_DECODE_PACKING")
    monkeypatch.setattr(decoding, "_onednn_packing", lambda: False)  # a torch without oneDNN
    assert decoding.decode_packing() == "mkl"
    monkeypatch.setattr(decoding, "_mkl_packing", lambda: False)
    assert decoding.decode_packing() == "none"
    monkeypatch.setenv("RELPOS_DECODE_PACKING", "mkl")  # asked for, not there: the plain layout
    assert decoding.decode_packing() == "none"


def test_native_decode_attention_serves_only_kernels_built_with_their_vectors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's attention is the native kernels' where they run on their vector code, and
    SDPA's where they were built without it (plain loops: several times SDPA's time); the
    logits are the full forward's either way."""
    from relpos.models import decoding

    model = _lm(max_distance=3).float()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(2))
    for vectorized in (True, False):
        monkeypatch.setattr(decoding, "_vectorized", lambda module, v=vectorized: v)
        with torch.no_grad():
            cache = model.new_cache(capacity=9, growable=False)
            model(ids[:, :5], cache=cache)
            step = StepDecoder(model)
            step.start(cache)
            assert (step._attend is not None) == vectorized
            got = torch.stack([step(ids[:, t], cache) for t in range(5, 9)], 1)
            torch.testing.assert_close(got, model(ids)[:, 5:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("packing", "kinds"), [
    ("relpos", ("panels", "panels", "panels")),
    ("onednn", ("transposed", "plain", "onednn")),
    ("mkl", ("transposed", "plain", "mkl")),
    ("none", ("transposed", "plain", "transposed")),
])
def test_native_panels_and_float32_layouts_follow_the_packing_and_the_batch(
        packing: str, kinds: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """The panels serve every batch size, batch 1 too; the other packings serve batches of
    more than one row, and batch 1 reads the weight with its longer side contiguous."""
    from relpos.models import decoding

    monkeypatch.setenv("RELPOS_DECODE_PACKING", packing)
    names = {decoding._PLAIN: "plain", decoding._TRANSPOSED: "transposed",
             decoding._MKL_PACKED: "mkl", decoding._ONEDNN_PACKED: "onednn",
             decoding._PANELS: "panels"}
    tall, wide = torch.randn(48, 16), torch.randn(16, 48)  # more outputs / more inputs
    got = (decoding._linear_layout(tall, 1, True)[0], decoding._linear_layout(wide, 1, True)[0],
           decoding._linear_layout(tall, 8, True)[0])
    assert tuple(names[k] for k in got) == kinds
    assert decoding._linear_layout(tall, 1, False) == (decoding._PLAIN, None)
    assert decoding._linear_layout(tall.double(), 1, True) == (decoding._PLAIN, None)


def test_decode_packing_ignores_an_unknown_name_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown name: one warning naming those allowed, and the default packing serves (as
    every RELPOS_* switch is read: relpos._env); before, every decode step raised."""
    from relpos import _env
    from relpos.models.decoding import decode_linear, decode_packing

    monkeypatch.delenv("RELPOS_DECODE_PACKING", raising=False)
    default = decode_packing()
    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.setenv("RELPOS_DECODE_PACKING", "blis")
    with pytest.warns(RuntimeWarning, match=r"RELPOS_DECODE_PACKING='blis' is none of relpos, "
                                            r"onednn, mkl, none \(or unset\); it is ignored"):
        assert decode_packing() == default
    w, x = torch.randn(3, 2), torch.randn(4, 2)
    torch.testing.assert_close(decode_linear(w, None, 4)(x), x @ w.T)


# ----------------------------------------------------------------------------- float32 layouts
def _steps(model: RelativeTransformerLM, batch: int, capacity: int
           ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of 12 steps after a 3-token prompt (row 1 left-padded), and the ids."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (batch, 15), generator=gen)
    mask = torch.ones(batch, 3, dtype=torch.bool)
    mask[min(1, batch - 1), :1] = False
    with torch.no_grad():
        cache = model.new_cache(capacity=capacity)  # growable: grows under the steps
        model(ids[:, :3], key_mask=mask, cache=cache)
        step = StepDecoder(model)
        step.start(cache)
        return [step(ids[:, t], cache) for t in range(3, 15)], ids


@pytest.mark.parametrize(("fast", "packing"), [(True, "relpos"), (True, "onednn"), (True, "mkl"),
                                               (True, "none"), (False, "relpos")])
@pytest.mark.parametrize("batch", [1, 4])
def test_steps_take_every_float32_linear_layout(
        batch: int, fast: bool, packing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the native panels (every batch size), the transposed weight or the weight as
    it is (batch 1 under the other packings), oneDNN's or MKL's packed one (batch > 1), and
    F.linear: each layout's steps give the full forward's logits to float32 rounding."""
    from relpos.models.decoding import decode_packing

    monkeypatch.setenv("RELPOS_DECODE_PACKING", packing)
    assert decode_packing() == packing  # the kernels are built, torch has MKL and oneDNN
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=32, num_heads=4, num_layers=2, max_distance=3)
    model = RelativeTransformerLM(cfg).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        cache = model.new_cache(capacity=20, growable=False)
        ids = torch.randint(0, V, (batch, 14))
        model(ids[:, :4], cache=cache)
        step = StepDecoder(model, fast_linears=fast)
        got = torch.stack([step(ids[:, t], cache) for t in range(4, 14)])
        torch.testing.assert_close(got.transpose(0, 1), model(ids)[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(max_distance=4), dict(max_distance=(0, 5)),
                                dict(max_distance=3, share_heads=False),
                                dict(max_distance=4, relative_keys=False)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_float32_steps_run_the_native_decode_attention(kw: dict) -> None:
    """float32 on the CPU: the step's attention is the native kernels' decode attention, and
    the logits of the unpadded rows are the full forward's to float32 rounding."""
    model = _lm(**kw).float()
    got, ids = _steps(model, 3, capacity=4)
    with torch.no_grad():
        full = model(ids)[:, 3:]
    torch.testing.assert_close(torch.stack(got, 1)[[0, 2]], full[[0, 2]], rtol=1e-4, atol=1e-4)
    step = StepDecoder(model)
    cache = model.new_cache(capacity=4)
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    step.start(cache)
    assert step._attend is not None  # the kernels are built here


@pytest.mark.parametrize(("S", "D", "Dv"), [(1, 64, 64), (7, 5, 9), (40, 17, 17), (300, 64, 32)])
def test_native_decode_attention_equals_sdpa(S: int, D: int, Dv: int) -> None:
    """One query per (batch, head) over S keys of a cache's storage (rows of a longer
    capacity), a strided query, a key mask hiding a row's first keys: SDPA's in float64 to
    float32 rounding; a head with every key hidden gets zeros."""
    from relpos.ops.native.build import load

    module = load()
    assert module is not None
    g = torch.Generator().manual_seed(S + D)
    B, H = 3, 2
    keys = torch.randn(B, H, S + 5, D, generator=g)[:, :, :S]
    values = torch.randn(B, H, S + 5, Dv, generator=g)[:, :, :S]
    q = torch.randn(B, 3, H, D, generator=g)[:, 0]  # as a step's fused QKV holds it
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, : S // 2] = False
    for key_mask in (None, mask):
        got = module.decode_attention(q, keys, values, key_mask)
        m = None if key_mask is None else key_mask[:, None, None, :]
        truth = F.scaled_dot_product_attention(q.double().unsqueeze(2), keys.double(),
                                               values.double(), attn_mask=m).squeeze(2)
        assert got.shape == (B, H, Dv) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5)
    hidden = mask.clone()
    hidden[2] = False
    got = module.decode_attention(q, keys, values, hidden)
    assert torch.equal(got[2], torch.zeros(H, Dv))


def test_native_decode_attention_refuses_what_does_not_fit() -> None:
    from relpos.ops.native.build import load

    module = load()
    assert module is not None
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 4)
    with pytest.raises(RuntimeError, match=r"do not fit query \[2, 3, 8\]"):
        module.decode_attention(q, k[:, :2], v, None)
    with pytest.raises(RuntimeError, match="takes float32 CPU tensors, got Double"):
        module.decode_attention(q.double(), k, v, None)
    with pytest.raises(RuntimeError, match=r"key_mask must be bool \(2, 5\), got Float"):
        module.decode_attention(q, k, v, torch.ones(2, 5))
    with pytest.raises(RuntimeError, match=r"takes query \(B, H, D\)"):
        module.decode_attention(q[0], k, v, None)


@pytest.mark.parametrize("rows", [0, 1, 5, 8, 13, 24])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (16, 7), (37, 64), (530, 96)])
def test_native_panel_linear_equals_f_linear(rows: int, n: int, k: int) -> None:
    """The panels (16 outputs each, the last one partial) at row counts around their blocks of
    8, with and without a bias, against F.linear in float64 (the panels' float32 rounding)."""
    from relpos.ops.native.build import load

    module = load()
    assert module is not None
    g = torch.Generator().manual_seed(n * 100 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    panels = module.pack_panels(w)
    assert panels.shape == ((n + 15) // 16, k, 16)
    for bias in (b, None):
        got = module.panel_linear(x, panels, bias, n)
        truth = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5 * k ** 0.5)
    xt = torch.randn(k, rows, generator=g).t()  # a non-contiguous view
    torch.testing.assert_close(module.panel_linear(xt, panels, b, n), F.linear(xt, w, b),
                               rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_native_panel_linear_refuses_what_does_not_fit() -> None:
    from relpos.ops.native.build import load

    module = load()
    assert module is not None
    panels = module.pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match=r"float32 CPU rows \(M, 8\), got Float \[3, 9\]"):
        module.panel_linear(torch.randn(3, 9), panels, None, 20)
    with pytest.raises(RuntimeError, match="N = 33 does not fit 2 panels of 16"):
        module.panel_linear(torch.randn(3, 8), panels, None, 33)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \(20\)"):
        module.panel_linear(torch.randn(3, 8), panels, torch.randn(19), 20)
    with pytest.raises(RuntimeError, match="pack_panels takes a float32 CPU weight"):
        module.pack_panels(torch.randn(4, 4, dtype=torch.float64))


def test_the_native_argument_is_deprecated() -> None:
    model = _lm(max_distance=3)
    ids = torch.zeros(1, 2, dtype=torch.long)
    token = torch.ones(1, dtype=torch.long)
    logits = []
    for kw in ({}, {"native": True}):
        cache = model.new_cache(capacity=8, growable=False)
        with torch.no_grad():
            model(ids, cache=cache)
            if kw:
                with pytest.warns(DeprecationWarning, match=r"native=\.\.\.\) has no effect"):
                    step = StepDecoder(model, **kw)
            else:
                step = StepDecoder(model)
            logits.append(step(token, cache))
    assert torch.equal(logits[0], logits[1])
    with pytest.raises(TypeError, match="native must be None, True or False, got 'yes'"):
        StepDecoder(model, native="yes")  # type: ignore[arg-type]
