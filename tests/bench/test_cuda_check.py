"""relpos.bench.cuda_check (``python -m relpos.bench.cuda_check``): its CPU-side parts
(arguments, shapes, report), so that the GPU benchmark is ready to run the day a GPU is
there."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cuda_check():
    from relpos.bench import cuda_check

    return cuda_check


def test_training_shapes_fill_the_batch(cuda_check):
    shapes = cuda_check.training_shapes(16384, cuda_check.TRAINING_LENGTHS, 32768)
    assert shapes[0] == (128, 128) and shapes[-2] == (2, 8192) and shapes[-1] == (1, 32768)
    assert all(B * n == 16384 for B, n in shapes[:-1])
    with pytest.raises(ValueError, match="length 300 does not divide the 16384 tokens"):
        cuda_check.training_shapes(16384, [300], None)


def test_arguments(cuda_check):
    args = cuda_check.parse_args(["--triton"])
    assert args.lengths == list(cuda_check.TRAINING_LENGTHS)
    assert args.backends == ["flash_regions", "triton"] and args.tokens == 16384
    assert cuda_check.parse_args([]).lengths[0] == 1024
    with pytest.raises(SystemExit):
        cuda_check.parse_args(["--backends", "nope"])


def test_report_renders_every_row(cuda_check):
    row = {"B": 2, "n": 8192, "base": "fa2", "triton fwd": 1.0, "fa2 fwd": 0.8,
           "fwd ratio": 1.25, "triton f+b": 3.0, "fa2 f+b": 2.5, "f+b ratio": 1.2,
           "triton MiB": 100.0, "fa2 MiB": 90.0, "triton out": 1e-3, "reference out": 2e-3,
           "triton dq": 1e-3, "reference dq": 2e-3, "triton drel_values": 1e-2,
           "reference drel_values": 3e-2}
    text = cuda_check.format_report([row, {**row, "n": 16384, "B": 1}],
                                    {"GPU": "none", "command": "python x"})
    assert "| 2 x 8192 | 1.000 | 0.800 | 1.25 |" in text
    assert "1.00e-03 (2.00e-03)" in text and "- **command**: `python x`" in text


def test_without_a_gpu_it_says_so(cuda_check, capsys):
    if cuda_check.torch.cuda.is_available():
        pytest.skip("a GPU is present: run the benchmark itself")
    assert cuda_check.main(["--quick"]) == 0
    assert "no CUDA device" in capsys.readouterr().out
