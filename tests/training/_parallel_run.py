"""The tiny run that tests/training/test_mesh_parallel.py trains in one process and on ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relpos.models import ModelConfig
from relpos.training import TrainConfig, train
from relpos.training.tasks import OffsetRecall


def run_tiny(out: Path, spec: dict[str, Any], **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    task = OffsetRecall((1, 3, 6), num_symbols=8)
    config = ModelConfig(vocab_size=task.vocab_size, d_model=16, num_layers=2, num_heads=2,
                         max_distance=(3, 2), causal=spec["causal"], dropout=spec["dropout"])
    train_config = TrainConfig(steps=spec["steps"], schedule_steps=spec.get("schedule"),
                               batch_size=4, length=24, warmup=1,
                               eval_lengths=(24,), eval_tokens=96, eval_every=1,
                               checkpoint_every=1)
    return train(config, task, train_config, out_dir=out, progress=False,
                 resume=spec.get("resume", False), overwrite=not spec.get("resume", False),
                 **kwargs)
