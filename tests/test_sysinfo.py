"""relpos._sysinfo: the one description of the machine that reports, runs and builds record."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from relpos import _sysinfo

X86 = """processor\t: 0
model name\t: Test CPU @ 2.0GHz
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile

processor\t: 1
model name\t: Another CPU
flags\t\t: fpu
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd\n\n"


def test_cpuinfo_reads_the_first_processor(tmp_path: Path) -> None:
    (tmp_path / "x86").write_text(X86)
    (tmp_path / "arm").write_text(ARM)
    x86, arm = str(tmp_path / "x86"), str(tmp_path / "arm")
    assert _sysinfo.cpu_model(x86) == "Test CPU @ 2.0GHz"
    assert _sysinfo.cpu_flags(x86) == frozenset({"fpu", "avx2", "avx512f", "avx512_bf16",
                                                  "amx_tile"})
    assert _sysinfo.isa(_sysinfo.cpu_flags(x86)) == "AVX2, AVX-512 (BF16 F), AMX (TILE)"
    assert _sysinfo.cpu_flags(arm) is None and _sysinfo.cpuinfo(arm)["Features"] == "fp asimd"
    assert _sysinfo.cpuinfo(str(tmp_path / "missing")) == {}
    assert _sysinfo.cpu_model(str(tmp_path / "missing"))  # falls back to the platform


def test_environment_is_plain_data_with_every_key() -> None:
    env = _sysinfo.environment(3)
    assert set(env) == {"cpu", "isa", "torch_cpu_capability", "logical_cpus", "platform",
                        "torch", "relpos", "python", "threads", "omp_wait_policy"}
    assert env["threads"] == 3 and env["torch"] == torch.__version__
    assert _sysinfo.environment()["threads"] == torch.get_num_threads()
    assert json.loads(json.dumps(env)) == env


def test_the_records_share_it() -> None:
    from relpos.bench import common
    from relpos.ops.native import build
    from relpos.training.experiment import run

    env = _sysinfo.environment(2)
    header = common.environment(2)
    assert header["ISA"].startswith(env["isa"]) and header["relpos"] == env["relpos"]
    assert run.environment is _sysinfo.environment
    flags = _sysinfo.cpuinfo().get("flags") or _sysinfo.cpuinfo().get("Features")
    if flags:
        assert build._cpu_flags() == " ".join(sorted(flags.split()))
