"""Training, checkpoints, data-parallel runs and the K sweep experiment.

Needs the ``train`` extra (safetensors, tqdm); figures need ``plot`` (matplotlib).
"""

from relpos.training.checkpoint import (
    FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from relpos.training.data_parallel import DistContext, init_distributed, launch
from relpos.training.mesh_parallel import Parallelism
from relpos.training.trainer import TrainConfig, evaluate, lr_at, train

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "DistContext",
    "Parallelism",
    "TrainConfig",
    "evaluate",
    "init_distributed",
    "launch",
    "load_checkpoint",
    "lr_at",
    "save_checkpoint",
    "train",
]
