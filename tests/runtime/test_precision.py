"""The precision figures of docs/reliability.md, held as tests: the cases of
benchmarks/precision.py (extreme positions and parameters of the generalized Gaussian prior, whose
log-prior is tabulated in float64 on the host) on both backends.

Naive float32 is no yardstick here: at queries 2**23 it is off by 1.6 in the output, so the
`2 * max|pt - ref| + atol` of docs/architecture.md ("Testing") would admit almost anything. These cases are held to the
float32 floor of tests/tolerance.py alone, `ATOL[float32] * max(1, max|ref|)`: a prior read from
its float64 distance table must stay that close at any position and size of the log-prior, and
so must the shipped Laplace on Triton (inline: a causal ramp measured from the nearest key).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from bamgen.runtime.triton.helpers import _lowp
from tests.tolerance import atol_for

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("precision_bench", ROOT / "benchmarks" / "precision.py")
precision = sys.modules["precision_bench"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(precision)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", precision.GGD_CASES, ids=lambda case: case.name)
def test_extreme_positions_and_parameters_match_float64(case, backend):
    [errors] = precision.run_case(precision.GGD, case, [backend], naive=False)
    assert errors.nonfinite == 0, errors
    assert errors.zero_rows == errors.ref_zero_rows, errors
    for name, err in errors.values.items():
        floor = atol_for(torch.float32, torch.tensor(errors.magnitudes[name]))
        assert err <= floor, f"{name}: {err:.2e} > {floor:.2e} ({case.name}, {backend})"


LAPLACE_INLINE = precision.Prior("laplace (inline)", precision.laplace, precision._laplace,
                                 lambda d, p: d == 0)


@pytest.mark.parametrize("case", precision.LAPLACE_CASES[::3], ids=lambda case: case.name)
def test_an_inline_prior_far_from_position_zero_on_triton(case):
    """Laplace as shipped: -|d|/b in float32 in the kernels (inline strategy, a causal ramp).
    Every key is thousands of tokens back, so the absolute logits are ~1e5 .. 3e6, whose float32
    rounding (up to 1/4) would swamp q.k: the kernels measure scores from each row's nearest key
    (_ramp_reference), forward and backward alike. Before, the forward summed a ramp from the
    tile's first row and the backward slope * d: db was off by 3e2 at 2**20 and 1e5 at 2**23."""
    assert case.q_offset >= 2 ** 12 and case.k_offset == 0 and case.Nk == 256
    [errors] = precision.run_case(LAPLACE_INLINE, case, ["triton"], naive=False)
    assert errors.nonfinite == 0, errors
    for name, err in errors.values.items():
        floor = atol_for(torch.float32, torch.tensor(errors.magnitudes[name]))
        assert err <= floor, f"{name}: {err:.2e} > {floor:.2e} ({case.name})"


@pytest.mark.parametrize("b", [0.5, 0.2])
def test_a_steep_ramp_near_its_keys_under_a_gpu_s_tiles(b, monkeypatch):
    """Laplace as shipped with a steep slope (b = 0.5, 0.2: 2 and 5 nats per token), queries
    at their keys, sm_90's 128-row query tiles. The forward measured a whole tile's scores
    from one reference key, the tile's first row, so row r of a tile carried r slopes (up to
    370 in log2 units) on top of its q.k, and lost the low bits of q.k to it: the output and
    every gradient (the backward rebuilds P from the forward's statistics) were off by 1e-5 to
    2.4e-5 of their size, past the float32 floor. Each row now has its own reference key."""
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", "sm_90")
    g = torch.Generator().manual_seed(0)
    n = 256
    q, k, v, dout = (torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64) for _ in range(4))
    d = torch.arange(n)[:, None] - torch.arange(n)[None]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    slope = torch.tensor([b], dtype=torch.float64, requires_grad=True)
    logit = leaves[0] @ leaves[1].transpose(-1, -2) / 8 - d.abs() / slope
    ref = torch.softmax(logit.masked_fill(d < 0, float("-inf")), -1) @ leaves[2]
    refs = [ref] + list(torch.autograd.grad(ref, leaves + [slope], dout))
    mine = [t.float().requires_grad_() for t in (q, k, v)]
    b32 = slope.detach().float().requires_grad_()
    out = precision.laplace.attention(*mine, b=b32, causal=True, backend="triton")
    got = [out] + list(torch.autograd.grad(out, mine + [b32], dout.float()))
    for name, x, r in zip(["out", "dq", "dk", "dv", "db"], got, refs):
        err = (x.double() - r).abs().max().item()
        floor = atol_for(torch.float32, r)
        assert err <= floor, f"{name}: {err:.2e} > {floor:.2e} (b = {b})"


@triton.jit
def _bf16_cast(X, Y, N: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(Y + at, _lowp(tl.load(X + at), tl.bfloat16))


def test_the_kernels_bfloat16_casts_round_to_nearest_even_as_a_gpu_does():
    """helpers._lowp, through which the kernels cast float32 to bfloat16 (P and dS for their
    products, the stored outputs): under the interpreter, whose own cast truncates, the bits of
    torch's round-to-nearest-even cast, which a GPU's cvt.rn gives (docs/reliability.md,
    "Interpreter rounding"): values across float32's range, ties either way, the largest finite
    values (which round to infinity), infinities, NaN, zeros and subnormals, and 1 - 6e-8 (the
    row max's P in one FFMA, which truncation made 0.996)."""
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.3895e38, -3.3895e38,
                            1 - 6e-8, 0.0, -0.0, 1e-40, -1e-40, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                            1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8)])
    spread = torch.randn(4096 - special.numel(), generator=g) * torch.logspace(
        -38, 38, 4096 - special.numel())
    x = torch.cat([special, spread]).float()
    y = torch.empty(4096, dtype=torch.bfloat16)
    _bf16_cast[(1,)](x, y, N=4096)
    want = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert bool(same.all()), (x[~same][:4], y[~same][:4], want[~same][:4])
    assert y[5] == 1.0   # 1 - 6e-8
