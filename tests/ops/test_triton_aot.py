"""Every configuration the triton backend can launch, compiled ahead of time for sm_80 (A100)
and sm_90 (H100) without a GPU: shared memory within the architecture's limit, no register
spills (``ptxas -v``). Each is compiled with every optional feature on (keys and values tables,
key mask, causal), the variant with the most live state, D = BLOCK_D, and bfloat16 operands for
the half-precision entries (float16 takes the same configuration).

The compiles run in a child process (``python -m relpos.ops.triton.aot``): this test process
loaded Triton under its interpreter (``tests/conftest.py``), and an interpreted Triton cannot
lower kernels. They are cached under pytest's cache directory (``.pytest_cache``), so a second
run takes seconds; a cold run compiles 36 kernels.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None and not os.environ.get("CI"):
    pytest.skip("triton is not installed (the dev extra has it on Linux; CI fails without it)",
                allow_module_level=True)

from relpos.ops.triton import configs

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernel", configs.KERNELS)
def test_every_configuration_compiles_within_limits(request, kernel, arch):
    cache = request.config.cache.mkdir("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), TRITON_DEFAULT_FP_FUSION="1")  # 3.9's default
    result = subprocess.run(
        [sys.executable, "-m", "relpos.ops.triton.aot", "--arch", str(arch), "--kernel", kernel,
         "--cache", str(cache)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    expected = {(d, cls) for (k, d, cls) in configs.CONFIGS if k == kernel}
    assert {(r["block_d"], r["dtype_class"]) for r in rows} == expected, result.stderr[-3000:]
    over = [r for r in rows if not r["within"]]
    assert not over, "\n".join(json.dumps(r) for r in over)
    assert result.returncode == 0, result.stderr[-3000:]
    for r in rows:  # the numbers, for the record (pytest -rA shows them)
        print(json.dumps(r))
