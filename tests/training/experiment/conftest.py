"""Fixtures of the K-sweep tests: a tiny sweep (``tiny``, on the fake standard library of
``tests/training/conftest.py``) and results documents built by hand (``synthetic``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relpos.training.experiment import ExperimentConfig


@pytest.fixture
def tiny(fake_stdlib: Path) -> ExperimentConfig:
    """A sweep of ``recall`` and ``pysrc`` that trains in seconds."""
    return ExperimentConfig(
        tasks=("recall", "pysrc"),
        ks=(0, 4),
        depths=(1,),
        baselines=("learned",),
        seeds=(0, 1),
        train_length=40,
        eval_lengths=(40, 80),
        steps=3,
        batch_size=4,
        d_model=16,
        num_heads=2,
        eval_tokens=400,
        code_ks=(2,),
        code_baselines=(),
        code_depth=1,
        code_train_length=16,
        code_eval_factors=(1, 4),
        code_steps=3,
        code_batch_size=4,
        code_eval_tokens=256,
        corpus_root=str(fake_stdlib),
        preset="custom",
    )


def _synthetic(accs: dict[int, tuple[float, float]], count: int = 400) -> dict[str, Any]:
    """A results document of recall runs: K -> (accuracy at d <= 4, at d > 4), 3 seeds,
    the seeds a little apart."""
    runs = []
    for k, (near, far) in accs.items():
        for seed, jitter in enumerate((-0.005, 0.0, 0.005)):
            by = {}
            for d in (2, 12, 16, 24):
                acc = min(1.0, max(0.0, (near if d <= 4 else far) + jitter))
                by[str(d)] = {"accuracy": round(acc * count) / count, "count": count}
            total = sum(v["accuracy"] * v["count"] for v in by.values())
            ev = {"length": 64, "loss": 0.0, "accuracy": total / (4 * count),
                  "count": 4 * count, "by": {"distance": by}}
            runs.append({"spec": {"task": "recall", "positions": "relative", "k": k,
                                  "depth": 1, "seed": seed},
                         "model_label": f"K={k}", "eval": [ev], "train": {"steps": 120}})
    cfg = ExperimentConfig(tasks=("recall",), ks=tuple(accs), depths=(1,), baselines=(),
                           eval_lengths=(64,)).to_dict()
    return {"config": cfg, "chance": {"recall": 0.0625}, "sweep_seconds": 1.0, "runs": runs,
            "environment": {"cpu": "Test CPU", "isa": "AVX2", "threads": 1}}


@pytest.fixture
def synthetic() -> Callable[..., dict[str, Any]]:
    """Builds a results document of recall runs by hand: ``synthetic({K: (accuracy at
    d <= 4, at d > 4)}, count=400)``, 3 seeds a little apart."""
    return _synthetic
