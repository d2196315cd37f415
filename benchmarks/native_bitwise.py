"""Records the native kernels' outputs on a fixed set of calls, or checks them bit for bit
against a record: the proof that a change of the C++ sources that should change no numerics
(a move, a reformat) changed none.

    python benchmarks/native_bitwise.py record DIR    # before the change
    python benchmarks/native_bitwise.py check DIR     # after it: every tensor bitwise equal

The calls: padded forward and backward (causal or not, query_start, key and dense masks, bool
and float, windows, shared and per-head tables, keys or values only, no tables, Dv != D,
scale, rows that see no key, several query and key blocks, a decode-like row), varlen forward
and backward (empty sequences, seqused_k, tables, causal), dropout with fixed seeds (the outputs
and the keep masks, padded and varlen), float32, float64, bfloat16 (on each 16-bit GEMM engine
this CPU and build have: widened tiles, libtorch's brgemm, VDPBF16PS tiles, AMX tiles) and
float16 (widened tiles), and decode steps of a small language model through
relpos.models.decoding.StepDecoder on the kernels' C++ step (packed linears and F.linear).
Each process runs them all; one process per float32 GEMM setting (the default, and
RELPOS_NATIVE_FLOAT_GEMM=brgemm), each printing the engines its kernels report
(gemm_engines()). Two threads; the kernels give the same bits
at every thread count.

The kernels load as the package builds them (RELPOS_CACHE_DIR as set; the tests' cache is the
repository's build/relpos-cache). Prints the number of calls and tensors recorded or checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

# (name, environment): a process per float32 GEMM setting
SETTINGS = {
    "default": {},
    "float_brgemm": {"RELPOS_NATIVE_FLOAT_GEMM": "brgemm"},
}
BF16_ENGINES = ("widened", "brgemm", "avx512bf16", "amx")


def _cases() -> Iterator[tuple[str, Callable[[], dict[str, object]]]]:
    """(name, run): each run returns its named output tensors."""
    import torch

    import relpos
    from relpos.ops.native import dropout_mask, dropout_mask_varlen

    def padded(dtype: torch.dtype, *, B: int = 2, H: int = 3, L: int = 37, S: int | None = None,
               D: int = 16, Dv: int | None = None, K: object = 4, tables: str = "kv",
               per_head: bool = False, causal: bool = False, query_start: int | None = None,
               mask: str | None = None, dropout: float = 0.0, scale: float | None = None,
               hide_row: bool = False, seed: int = 0) -> Callable[[], dict[str, object]]:
        def run() -> dict[str, object]:
            S_ = L if S is None else S
            Dv_ = D if Dv is None else Dv
            gen = torch.Generator().manual_seed(seed)

            def rand(*shape: int) -> torch.Tensor:
                return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

            q, k, v = rand(B, H, L, D), rand(B, H, S_, D), rand(B, H, S_, Dv_)
            left, right = (K, K) if isinstance(K, int) else K
            R = left + right + 1
            head = (H,) if per_head else ()
            ak = rand(*head, R, D) * 0.5 if "k" in tables else None
            av = rand(*head, R, Dv_) * 0.5 if "v" in tables else None
            kw: dict[str, object] = {}
            if mask == "key":
                km = torch.rand(B, S_, generator=gen) > 0.3
                km[:, 0] = True
                kw["key_mask"] = km
            elif mask == "bool":
                am = torch.rand(B, 1, L, S_, generator=gen) > 0.25
                if hide_row:
                    am[0, 0, 1, :] = False
                kw["attn_mask"] = am
            elif mask == "float":
                am = torch.randn(B, H, L, S_, generator=gen, dtype=torch.float64)
                am = am.masked_fill(torch.rand(B, H, L, S_, generator=gen) < 0.2, float("-inf"))
                if hide_row:
                    am[1, 2, 3, :] = float("-inf")
                kw["attn_mask"] = am.to(dtype)
            leaves = [t for t in (q, k, v, ak, av) if t is not None]
            for t in leaves:
                t.requires_grad_(True)
            torch.manual_seed(seed + 1)  # the dropout seed the backend draws
            out = relpos.relative_attention(
                q, k, v, max_distance=K, rel_keys=ak, rel_values=av, is_causal=causal,
                query_start=query_start, dropout_p=dropout, scale=scale,
                implementation="native", **kw)
            grad = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
            grads = torch.autograd.grad(out, leaves, grad)
            return {"out": out.detach(), **_gradients(q, k, v, ak, av, grads)}
        return run

    def varlen(dtype: torch.dtype, lengths_q: list[int], lengths_k: list[int], *,
               H: int = 2, D: int = 16, Dv: int | None = None, K: object = 3,
               tables: str = "kv", causal: bool = False, used: list[int] | None = None,
               dropout: float = 0.0, seed: int = 0) -> Callable[[], dict[str, object]]:
        def run() -> dict[str, object]:
            gen = torch.Generator().manual_seed(seed)
            Dv_ = D if Dv is None else Dv

            def rand(*shape: int) -> torch.Tensor:
                return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

            cu_q = torch.tensor([0, *lengths_q]).cumsum(0)
            cu_k = torch.tensor([0, *lengths_k]).cumsum(0)
            Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
            q, k, v = rand(Tq, H, D), rand(Tk, H, D), rand(Tk, H, Dv_)
            left, right = (K, K) if isinstance(K, int) else K
            R = left + right + 1
            ak = rand(R, D) * 0.5 if "k" in tables else None
            av = rand(H, R, Dv_) * 0.5 if "v" in tables else None
            leaves = [t for t in (q, k, v, ak, av) if t is not None]
            for t in leaves:
                t.requires_grad_(True)
            torch.manual_seed(seed + 1)
            out = relpos.relative_attention_varlen(
                q, k, v, cu_q, cu_k, max_distance=K, rel_keys=ak, rel_values=av,
                is_causal=causal, dropout_p=dropout,
                seqused_k=None if used is None else torch.tensor(used),
                implementation="native")
            grad = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
            grads = torch.autograd.grad(out, leaves, grad)
            return {"out": out.detach(), **_gradients(q, k, v, ak, av, grads)}
        return run

    f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
    # the padded calls, float32 and float64
    padded_cases = {
        "plain": dict(),
        "causal": dict(causal=True, K=8),
        "causal_per_head": dict(causal=True, per_head=True, K=5),
        "query_start": dict(L=20, S=45, causal=True, K=3),
        "query_start_mid": dict(L=10, S=45, query_start=12, K=2, causal=True),
        "key_mask": dict(mask="key", K=6),
        "bool_mask": dict(mask="bool", hide_row=True),
        "float_mask": dict(mask="float", causal=True, hide_row=True),
        "window": dict(K=(5, 2), causal=True),
        "window_wide": dict(K=(2, 7)),
        "keys_only": dict(tables="k", K=3),
        "values_only": dict(tables="v", K=3, causal=True),
        "no_tables": dict(tables="", K=3, causal=True),
        "k_beyond_n": dict(L=9, K=20),
        "dv": dict(Dv=24, D=8, K=4),
        "scale": dict(scale=0.3, K=2),
        "dropout": dict(dropout=0.2, K=4, causal=True),
        "dropout_masks": dict(dropout=0.3, K=2, mask="float"),
        "blocks": dict(B=1, H=2, L=300, S=700, K=16, causal=True, D=32),
        "blocks_noncausal": dict(B=1, H=1, L=260, S=530, K=16, D=64),
        "decode_row": dict(B=2, H=2, L=1, S=900, K=8),
        "decode_rows": dict(B=1, H=2, L=5, S=600, K=8, causal=True),
        "long_d64": dict(B=2, H=2, L=130, K=16, D=64, causal=True),
    }
    for name, kw in padded_cases.items():
        yield f"f32/{name}", padded(f32, **kw)
    for name in ("plain", "causal", "float_mask", "window", "dropout", "blocks", "decode_row",
                 "values_only"):
        yield f"f64/{name}", padded(f64, **padded_cases[name])
    # 16-bit: each engine (the environment is read on every bfloat16 call)
    half_cases = ("plain", "causal_per_head", "float_mask", "key_mask", "dropout", "blocks",
                  "long_d64", "decode_rows", "dv", "no_tables")
    for engine in BF16_ENGINES:
        for name in half_cases:
            yield f"bf16_{engine}/{name}", _with_env(
                {"RELPOS_NATIVE_BF16_GEMM": engine}, padded(bf16, **padded_cases[name]))
    for name in ("plain", "causal_per_head", "dropout", "long_d64"):  # always widened tiles
        yield f"f16/{name}", padded(f16, **padded_cases[name])
    # varlen
    varlen_cases = {
        "plain": ([5, 0, 33, 130], [5, 0, 33, 130], dict()),
        "causal": ([5, 0, 33, 130], [9, 0, 40, 130], dict(causal=True, K=6)),
        "seqused": ([3, 7, 20], [10, 12, 30], dict(used=[5, 7, 24], causal=True)),
        "window": ([17, 64], [17, 70], dict(K=(4, 1), causal=True)),
        "no_tables": ([8, 300], [8, 300], dict(tables="", causal=True, D=32)),
        "keys_only": ([8, 50], [12, 50], dict(tables="k", Dv=8)),
        "dropout": ([6, 40, 1], [6, 45, 1], dict(dropout=0.25, causal=True)),
        "many": ([3] * 70 + [9], [3] * 70 + [11], dict(K=2)),  # > 64: gradient groups
    }
    for name, (lq, lk, kw) in varlen_cases.items():
        yield f"varlen_f32/{name}", varlen(f32, lq, lk, **kw)  # type: ignore[arg-type]
    for name in ("plain", "causal", "dropout"):
        lq, lk, kw = varlen_cases[name]
        yield f"varlen_f64/{name}", varlen(f64, lq, lk, **kw)  # type: ignore[arg-type]
    for engine in BF16_ENGINES:
        for name in ("plain", "causal", "seqused", "dropout"):
            lq, lk, kw = varlen_cases[name]
            yield f"varlen_bf16_{engine}/{name}", _with_env(
                {"RELPOS_NATIVE_BF16_GEMM": engine},
                varlen(bf16, lq, lk, **kw))  # type: ignore[arg-type]

    # the keep masks
    def masks() -> dict[str, object]:
        seed = torch.tensor([123456789, 987654321], dtype=torch.int64)
        cu_q = torch.tensor([0, 5, 5, 40])
        cu_k = torch.tensor([0, 7, 9, 50])
        out: dict[str, object] = {"padded": dropout_mask(seed, (2, 3, 17, 29), 0.3)}
        for i, m in enumerate(dropout_mask_varlen(seed, cu_q, cu_k, 2, 0.4,
                                                  seqused_k=torch.tensor([6, 2, 30]))):
            out[f"varlen{i}"] = m
        return out

    yield "dropout_masks", masks

    # decode steps through the kernels' C++ step
    def decode(fast_linears: bool) -> Callable[[], dict[str, object]]:
        def run() -> dict[str, object]:
            from relpos.models import ModelConfig, RelativeTransformerLM
            from relpos.models.decoding import StepDecoder

            torch.manual_seed(3)
            model = RelativeTransformerLM(ModelConfig(
                vocab_size=50, d_model=64, num_heads=4, num_layers=2, max_distance=4)).eval()
            cache = model.new_cache(capacity=24, growable=False)
            prompt = torch.randint(0, 50, (3, 7))
            out: dict[str, object] = {}
            with torch.no_grad():
                out["prompt"] = model(prompt, cache=cache)
                step = StepDecoder(model, fast_linears=fast_linears, native=True)
                token = prompt[:, -1]
                for i in range(6):
                    logits = step(token, cache)
                    out[f"step{i}"] = logits
                    token = logits.argmax(-1)
            return out
        return run

    yield "decode/packed_linears", decode(True)
    yield "decode/f_linear", decode(False)


def _gradients(q: object, k: object, v: object, ak: object, av: object,
               grads: tuple[object, ...]) -> dict[str, object]:
    """{"dq": ..., "dk": ...}: the gradients of the leaves given (the tables may be None)."""
    names = [n for n, t in (("q", q), ("k", k), ("v", v), ("ak", ak), ("av", av)) if t is not None]
    return {"d" + n: g for n, g in zip(names, grads, strict=True)}


def _with_env(env: dict[str, str], run: Callable[[], dict[str, object]]
              ) -> Callable[[], dict[str, object]]:
    def wrapped() -> dict[str, object]:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return run()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return wrapped


def _run_setting(out_file: Path) -> None:
    """Runs every case in this process; saves {case/tensor: tensor} and the engines seen."""
    import torch

    from relpos.ops.native.build import gemm_engines, load

    torch.set_num_threads(2)
    module = load()
    if module is None:
        raise SystemExit("the native kernels are not available")
    results: dict[str, object] = {}
    for name, run in _cases():
        engine = name.split("/")[0]
        if engine.startswith(("bf16_", "varlen_bf16_")):
            want = engine.rsplit("_", 1)[1]
            os.environ["RELPOS_NATIVE_BF16_GEMM"] = want
            got = gemm_engines(module)["bfloat16"]
            del os.environ["RELPOS_NATIVE_BF16_GEMM"]
            if got != want:  # an engine this CPU or build lacks runs as the next one: skip
                continue
        for key, tensor in run().items():
            results[f"{name}/{key}"] = tensor
    results["_build_info"] = module.build_info()
    results["_gemm_engines"] = ", ".join(f"{d} {e}" for d, e in gemm_engines(module).items())
    torch.save(results, out_file)


def _bits_equal(a: object, b: object) -> bool:
    import torch

    if isinstance(a, str) or isinstance(b, str):
        return a == b
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "_run":
        _run_setting(Path(argv[2]))
        return 0
    if len(argv) != 2 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    import torch

    mode, directory = argv[0], Path(argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    calls = tensors = differ = 0
    for setting, env in SETTINGS.items():
        target = directory / f"{setting}.pt"
        out_file = target if mode == "record" else directory / f"{setting}.now.pt"
        subprocess.run([sys.executable, __file__, "_run", setting, str(out_file)],
                       env={**os.environ, **env}, check=True)
        now = torch.load(out_file)
        calls += len({k.rsplit("/", 1)[0] for k in now if not k.startswith("_")})
        tensors += sum(not k.startswith("_") for k in now)
        print(f"{setting}: {now['_build_info']}; GEMMs: {now['_gemm_engines']}")
        if mode == "check":
            before = torch.load(target)
            for key in sorted(set(before) | set(now)):
                if key.startswith("_"):
                    continue
                if key not in before or key not in now or not _bits_equal(before[key], now[key]):
                    differ += 1
                    print(f"  DIFFERS: {setting} {key}")
            out_file.unlink()
    verb = "recorded" if mode == "record" else "checked"
    print(f"{verb} {calls} calls ({tensors} tensors) in {len(SETTINGS)} settings"
          + (f": {tensors - differ} bitwise identical, {differ} differ" if mode == "check"
             else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
