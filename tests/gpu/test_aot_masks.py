"""The kernels specialised for masks compile ahead of time with no spills (issue: masks cost
only where used). `bamgen inspect --layout padded|packed` compiles the kernels with key_mask and
per-row offsets, or with packed documents and key_mask; the plain kernels (no flag) are those of
tests/gpu/test_aot.py, unchanged by the layout code (the flags are constexpr: off, nothing of it is
compiled). One prior per tile kind ('light' ALiBi, and NoPE for packed documents, 'table' GGD, 'general'
SSMax, 'heavy' FIRE, whose masked forward kept its tile and spilled until
launch.heavy_masked_forward), head dim 128 (the register-bound case), both GPU families.
"""
import pytest

from tests.gpu.test_aot import KERNELS, PRIOR_DIR, SHARED_LIMIT, _inspect


# head dim 128 on both families in every run; 64 on sm_80 in `make test-full` (the dK/dV kernels
# of BAM-SSMax packed at 64 on sm_80 and NoPE's at 128 spilled 32 and 8 bytes until they read
# their rows' statistics from the preprocess kernel: docs/performance.md, "The dK/dV loop's row
# statistics")
PACKED_SHAPES = [("sm_80", 128), ("sm_90", 128),
                 pytest.param("sm_80", 64, marks=pytest.mark.aot_full)]


@pytest.mark.slow
@pytest.mark.parametrize("arch, head_dim", PACKED_SHAPES)
@pytest.mark.parametrize("prior", ["uniform", "laplace", "generalized_gaussian", "bam_ssmax", "fire"])
def test_packed_kernels_compile_without_spills(prior, arch, head_dim):
    report = _inspect(PRIOR_DIR / f"{prior}.yaml", arch, head_dim, "--layout", "packed")
    assert report["layout"] == "packed"
    # packed documents always take the prefill kernel: no decode kernels in this layout
    # (a table prior's table kernels are the same in every layout: compiled with the plain one)
    assert {k["name"] for k in report["kernels"]} == KERNELS - {"attn_decode", "decode_combine"}
    for kernel in report["kernels"]:
        assert 0 < kernel["registers"] <= 255, kernel
        assert kernel["shared_bytes"] <= SHARED_LIMIT[arch], kernel
        assert kernel["stack_bytes"] == 0 and kernel["spill_bytes"] == 0, kernel


# GGD and FIRE at head dim 128 on sm_90 in every run; the light and general kinds' key-mask
# kernels (ALiBi's at 64 and FoX's at 128 on sm_80 spilled 8 bytes, BAM-SSMax's at 64 16, until
# the same change) on sm_80 in `make test-full`
PADDED = [pytest.param(prior, "sm_90", 128, id=f"{prior}-128-sm_90")
          for prior in ("generalized_gaussian", "fire")] + [
    pytest.param(prior, "sm_80", dim, id=f"{prior}-{dim}-sm_80", marks=pytest.mark.aot_full)
    for prior in ("laplace", "forget_gate", "bam_ssmax") for dim in (64, 128)]


@pytest.mark.slow
@pytest.mark.parametrize("prior, arch, head_dim", PADDED)
def test_padded_kernels_compile_without_spills(prior, arch, head_dim):
    report = _inspect(PRIOR_DIR / f"{prior}.yaml", arch, head_dim, "--layout", "padded")
    # batched generation decodes too (the table kernels: with the plain layout)
    assert {k["name"] for k in report["kernels"]} == KERNELS
    for kernel in report["kernels"]:
        assert kernel["stack_bytes"] == 0 and kernel["spill_bytes"] == 0, kernel


# The dQ kernels that split off their steady run (tiles.DQ_STEADY_AT: the split raises
# registers) with a key mask and with packed documents: the light, table and general kinds at
# head dim 64 on sm_90 in every run (GGD's takes 242-254 registers), the light kind at 128 on
# sm_90 and 64 on sm_80 in `make test-full` (docs/performance.md, "The dQ kernel's steady run")
SPLIT_DQ = [pytest.param(prior, "sm_90", 64, layout, id=f"{prior}-64-sm_90-{layout}")
            for prior in ("uniform", "laplace", "generalized_gaussian", "bam_ssmax")
            for layout in ("padded", "packed")] + [
    pytest.param(prior, arch, dim, layout, id=f"{prior}-{dim}-{arch}-{layout}",
                 marks=pytest.mark.aot_full)
    for prior in ("uniform", "laplace", "forget_gate") for arch, dim in (("sm_90", 128), ("sm_80", 64))
    for layout in ("padded", "packed")]


@pytest.mark.slow
@pytest.mark.parametrize("prior, arch, head_dim, layout", SPLIT_DQ)
def test_split_dq_kernels_compile_without_spills_with_masks(prior, arch, head_dim, layout):
    report = _inspect(PRIOR_DIR / f"{prior}.yaml", arch, head_dim, "--layout", layout,
                      "--kernel", "attn_bwd_dq")
    assert "attn_bwd_dq" in {k["name"] for k in report["kernels"]}   # (and the forward)
    for kernel in report["kernels"]:
        assert 0 < kernel["registers"] <= 255, kernel
        assert kernel["stack_bytes"] == 0 and kernel["spill_bytes"] == 0, kernel
