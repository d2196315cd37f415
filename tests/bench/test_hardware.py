"""What every benchmark report records about the machine (relpos.bench.hardware and the
header of relpos.bench.common), and the OMP_WAIT_POLICY warning."""

from __future__ import annotations

import pytest
import torch

from relpos._sysinfo import hardware as sysinfo_hardware
from relpos.bench import common, hardware


def test_cpu_flags_and_isa(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n"
                       "flags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16\n"
                       "\nprocessor\t: 1\nflags\t\t: fpu\n")
    flags = hardware.cpu_flags(str(cpuinfo))
    assert flags is not None and {"avx2", "avx512f", "amx_tile"} <= flags and "fpu" in flags
    assert hardware.isa(flags) == "AVX2, AVX-512 (BF16 BW F), AMX (BF16 TILE)"
    assert hardware.isa(frozenset({"avx", "avx2"})) == "AVX2, no AVX-512, no AMX"
    assert hardware.isa(frozenset()) == "no AVX2, no AVX-512, no AMX"
    assert hardware.cpu_flags(str(tmp_path / "missing")) is None
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert hardware.cpu_flags(str(tmp_path / "arm")) is None


def test_header_records_cpu_isa_threads_and_omp_policy(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = common.environment(torch.get_num_threads())
    assert env["hardware"] == sysinfo_hardware()  # CPU model, visible CPUs, OS
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), None)
    except OSError:
        model = None
    if model:
        assert env["hardware"].startswith(model)
    assert env["ISA"].startswith(hardware.isa())
    assert env["ISA"].endswith(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    assert any(word in env["ISA"] for word in ("AVX2", "unknown"))
    assert env["threads"] == str(torch.get_num_threads())
    assert env["torch"] == torch.__version__
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert common.environment(1)["OMP_WAIT_POLICY"] == "unset"
    lines = common.markdown_meta(common.environment(1))
    assert "- **OMP_WAIT_POLICY**: unset" in lines and "- **threads**: 1" in lines


def test_omp_warning_only_when_unset(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    warning = hardware.omp_warning("relpos bench --preset training")
    assert warning is not None and "\n" not in warning
    assert "10x" in warning and "OMP_WAIT_POLICY=PASSIVE relpos bench --preset training" in warning
    assert "--omp-wait-policy passive" in warning
    for value in ("PASSIVE", "active"):
        monkeypatch.setenv("OMP_WAIT_POLICY", value)
        assert hardware.omp_wait_policy() == value
        assert hardware.omp_warning("relpos bench") is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "")
    assert hardware.omp_wait_policy() == "unset"


@pytest.mark.parametrize("policy", ["PASSIVE", None])
def test_cli_warns_when_unset(monkeypatch, capsys, policy) -> None:  # type: ignore[no-untyped-def]
    import relpos.bench.attention
    from relpos.cli import main

    ran = []
    monkeypatch.setattr(relpos.bench.attention, "run_attention", lambda args: ran.append(1) or 0)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert main(["bench", "--lengths", "8", "--no-memory"]) == 0
    err = capsys.readouterr().err
    assert ran == [1]
    if policy is None:
        assert "warning: OMP_WAIT_POLICY is unset" in err and "OMP_WAIT_POLICY=PASSIVE" in err
    else:
        assert "OMP_WAIT_POLICY" not in err
