"""One rank of tests/training/test_mesh_parallel.py (a script: RANK WORLD PORT OUT SPEC).

SPEC is JSON: {"cp": int, "fsdp": bool, "ac": bool, "causal": bool, "dropout": float,
"steps": int, "resume": bool}. Trains the test's tiny run with relpos.training.train under
that parallelism and, on rank 0, saves the final weights and the history to OUT/result.pt.
Run by the test with a timeout, never alone.
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _parallel_run import run_tiny

from relpos.training.data_parallel import DistContext
from relpos.training.mesh_parallel import Parallelism


def main() -> int:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    out, spec = Path(sys.argv[4]), json.loads(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=90))
    try:
        if spec.get("check") == "optimizer_order":
            _optimizer_order(rank, world, out)
            return 0
        par = Parallelism(context_parallel=spec["cp"], fsdp=spec["fsdp"],
                          activation_checkpointing=spec["ac"], mode=spec.get("mode", "ring"))
        model, metrics = run_tiny(out, spec, ctx=DistContext(rank=rank, world_size=world),
                                  parallel=par)
        if rank == 0:
            torch.save({"weights": model.state_dict(), "history": metrics["history"],
                        "parallelism": metrics["parallelism"]}, out / "result.pt")
        del model, metrics  # the sharded model goes before the group it runs collectives in
    finally:
        gc.collect()
        dist.destroy_process_group()
    return 0


def _optimizer_order(rank: int, world: int, out: Path) -> None:
    """Load one single-process AdamW state into an FSDP2 model on every rank, each rank
    holding the state's parameters and entries in an order of its own (as a checkpoint read
    back in each process may), and save what each sharded state gathers to in full."""
    import random

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from relpos.models import ModelConfig, build_model
    from relpos.training.mesh_parallel import _names, full_state, load_optimizer_state
    from relpos.training.trainer import _param_groups

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=12, d_model=16, num_layers=2, num_heads=2,
                                    max_distance=2, max_length=8))
    plain = torch.optim.AdamW(_param_groups(model, 0.01), lr=1e-2)
    for _ in range(2):
        model(torch.randint(0, 12, (2, 8))).square().mean().backward()
        plain.step()
    state = plain.state_dict()
    names = _names(model, plain.param_groups)
    shuffle = random.Random(rank)
    order = sorted(state["state"], key=lambda _: shuffle.random())
    mixed = {"state": {i: dict(sorted(state["state"][i].items(),
                                      key=lambda _: shuffle.random())) for i in order},
             "param_groups": state["param_groups"]}
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = torch.optim.AdamW(_param_groups(model, 0.01), lr=1e-2)
    load_optimizer_state(model, sharded, mixed, names)
    _, back = full_state(model, sharded, names, fsdp=True)
    if rank == 0:
        torch.save({"want": state, "got": back}, out / "result.pt")


if __name__ == "__main__":
    sys.exit(main())
