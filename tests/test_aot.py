"""Every shipped prior's kernels compile ahead of time for A100 (sm_80) and H100 (sm_90).

No GPU is needed: Triton compiles to a cubin for a GPUTarget (`bamgen inspect`, run in a
subprocess because the test session runs Triton in interpreter mode). A compile error in any
forward or backward kernel (a template bug, a printer emitting something Triton rejects, shared
memory over the target's limit) fails here, and so does a kernel that spills registers to the
stack (DESIGN.md §3: no spills for head dims up to 128). Figures: docs/performance.md.
"""
import json
import os

import pytest

from bamgen.resources import shipped_priors
from tests.helpers import run_cli

PRIORS = shipped_priors()
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
KERNELS = {"attn_fwd", "bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("prior", PRIORS, ids=lambda p: p.stem)
def test_kernels_compile_for_gpu(prior, arch, head_dim):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = run_cli("inspect", str(prior), "--arch", arch, "--dtype", "bf16",
                  "--head-dim", str(head_dim), "--json", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert {k["name"] for k in report["kernels"]} == KERNELS
    for kernel in report["kernels"]:
        assert 0 < kernel["registers"] <= 255, kernel
        assert kernel["shared_bytes"] <= SHARED_LIMIT[arch], kernel
        assert kernel["stack_bytes"] == 0 and kernel["spill_bytes"] == 0, kernel
        if kernel["name"] != "bwd_preprocess":      # tensor cores in every main loop
            loop = kernel["main_loop"]
            assert loop["mma"] > 0 and loop["total"] < kernel["sass"]["total"], kernel["name"]
            assert kernel["model"]["cycles_per_tile"] > 0
    fwd = next(k for k in report["kernels"] if k["name"] == "attn_fwd")
    if arch == "sm_90":   # Hopper's warpgroup MMA, not the Ampere fallback
        assert all(op.startswith("HGMMA") for op in fwd["main_loop"]["mma_shapes"]), fwd
    assert report["model"]["cycles_per_tile"] == fwd["model"]["cycles_per_tile"]
