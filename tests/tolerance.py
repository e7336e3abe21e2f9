"""The tolerance check of docs/architecture.md, "Testing" (FlashAttention's scheme).

Inputs are rounded to the test dtype first; ``ref`` is the float64 reference on those rounded
inputs, ``pt`` the same naive math in the test dtype (``tests/reference.py``).  A kernel result
``out`` passes when::

    |out - ref|  <=  2 * max|pt - ref|  +  atol          (at every element)

for the output and for dq, dk, dv and every prior-parameter gradient.  With a scalar atol this is
FlashAttention's ``max|out - ref| <= 2 * max|pt - ref| + atol``; here atol has an elementwise
part (below).

Choice of ``atol`` (fixed once, per dtype; never loosened to make a failing kernel pass)
-----------------------------------------------------------------------------------------
``2 * max|pt - ref|`` carries the test: a kernel may be at most twice as far from the exact answer
as plain torch in the same precision.  ``atol`` is only a floor for the cases where ``pt`` happens
to be (nearly) exact — e.g. a single key (P = 1 exactly) or a row where all the weight sits on one
key — while the kernel legitimately differs by a few roundings (another accumulation order,
exp2 with log2(e) folded into the scale, fp32 online-softmax rescaling, a block-partial sum of the
parameter gradients).

``atol = ATOL[dtype] * max(1, max|ref|) + ACCUM_EPS * gross`` (the second part, applied element by
element, is explained below):

* The base values are about one unit of the format for fp16 (eps = 2**-10 ≈ 9.8e-4 → 1e-3) and
  bf16 (eps = 2**-7 ≈ 7.8e-3 → 8e-3): a kernel may be off by one rounding of the stored result
  even where ``pt`` is exact.  For float32 (eps ≈ 1.2e-7) the floor is 1e-5, about 2**7 ulps,
  because float32 ``pt`` is itself often exact to within an ulp while the kernel's exp2/log2
  lowering of the prior and its block-wise accumulation differ from torch's by tens of ulps.
* Rounding errors are relative, so the floor scales with the size of the quantity, never below
  the base value: this is what makes one constant sensible for the output (|out| ≲ max|v|), for
  dq/dk/dv, and for a parameter gradient, which is a sum over B·Nq·Nk terms and can be
  several orders of magnitude larger than 1.

Where the naive math in the test dtype overflows although the float64 answer is finite (a
denormal parameter, the derivative of a power at a tiny base), ``pt`` is no yardstick: those
entries are held to ``atol`` alone.

A gradient can also cancel: dS = P * (dP - rowsum(P * dP)) is exactly 0 with a single visible
key, and a parameter gradient sum_ij dS_ij * dlogit_ij/dtheta can be ~0 while its terms are
large (dlogit/db = |d|/b**2 is up to ~500 for b = 0.5).  Naive torch (``pt``) then happens to be
exact — its softmax backward subtracts two identical products — while the design's backward
(docs/architecture.md, "Kernels": delta = rowsum(dO * O), dS = P * (dP - delta), dP and delta summed in another
order) carries float32 rounding error proportional to the *terms*, not to the result.  So the floor
has a second part, ``ACCUM_EPS * gross``, element by element (per head for a parameter
gradient): ``gross`` is the reference's result recomputed with every product and sum replaced by
its absolute value (``reference.gross_magnitudes``: the size of the terms that cancel), and
``ACCUM_EPS = 2 * 2**-23``, two float32 epsilons, since every backend accumulates in float32
whatever the input dtype.  A D-term dot product summed in another order can differ by up to D
units of roundoff of its absolute sum; in practice (~500 Hypothesis examples, both backends, all
dtypes) correct kernels needed at most 0.3 epsilons of it, so two leave a margin without making
the term a hiding place.  It is dtype-independent on purpose: it admits float32 reordering
noise, never an error of the storage precision (e.g. rounding O to bf16 before
delta = rowsum(dO * O)), which is 2**16 times larger for bf16.  Being elementwise, a huge
``gross`` in one head does not relax the check of another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ATOL = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


ACCUM_EPS = 2 * 2.0 ** -23


def atol_for(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """The scalar part of the floor: ATOL[dtype] * max(1, max|ref|)."""
    mag = ref.detach().double().abs().max().item() if ref.numel() else 0.0
    return ATOL[dtype] * max(1.0, mag)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| in float64; NaN if either holds a NaN (so that the check fails)."""
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    diff = (a.detach().double() - b.detach().double()).abs()
    if torch.isnan(diff).any():
        return float("nan")
    return diff.max().item()


@dataclass
class Verdict:
    name: str
    err: float  # max|out - ref|
    pt_err: float  # max|pt - ref|
    atol: float  # the floor at the tightest element (the element with the least slack)
    ok: bool
    tight_err: Optional[float] = None  # |out - ref| at that element, when the floor is elementwise

    @property
    def bound(self) -> float:
        return 2 * self.pt_err + self.atol

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        if self.tight_err is None:
            return (f"{self.name}: max|out-ref|={self.err:.3e} bound=2*{self.pt_err:.3e}+{self.atol:.1e}"
                    f"={self.bound:.3e} {verdict}")
        return (f"{self.name}: max|out-ref|={self.err:.3e}; tightest element |out-ref|={self.tight_err:.3e} "
                f"bound=2*{self.pt_err:.3e}+{self.atol:.1e}={self.bound:.3e} {verdict}")


def verdict(name: str, out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor, dtype: torch.dtype,
            gross: Optional[torch.Tensor] = None) -> Verdict:
    """The check, element by element where ``gross`` is given:
    |out - ref| <= 2 max|pt - ref| + ATOL[dtype] max(1, max|ref|) + ACCUM_EPS gross (elementwise)."""
    err = max_abs_diff(out, ref)
    # where the naive float32 math itself overflows (pt non-finite, ref finite: a denormal
    # parameter, a power of a huge number) it is no yardstick: such entries are held to the floor
    pt = torch.where(torch.isfinite(pt.double()) | ~torch.isfinite(ref.double()), pt.double(), ref.double())
    pt_err = max_abs_diff(pt, ref)
    base = atol_for(dtype, ref)
    if err != err or pt_err != pt_err:  # NaN never passes
        return Verdict(name, err, pt_err, base, False)
    if gross is None or gross.numel() == 0:
        return Verdict(name, err, pt_err, base, err <= 2 * pt_err + base)
    diff = (out.detach().double() - ref.detach().double()).abs().reshape(-1)
    floor = (base + ACCUM_EPS * gross.detach().double().abs()).reshape(-1)
    slack = 2 * pt_err + floor - diff
    tight = int(torch.argmin(slack))
    return Verdict(name, err, pt_err, float(floor[tight]), bool((slack >= 0).all()), float(diff[tight]))


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor, dtype: torch.dtype,
                 gross: Optional[torch.Tensor] = None, context: Optional[str] = None) -> Verdict:
    v = verdict(name, out, ref, pt, dtype, gross)
    if not v.ok:
        msg = str(v)
        if context:
            msg += f"\n  case: {context}"
        raise AssertionError(msg)
    return v


def assert_all_close(results, dtype: torch.dtype, context: Optional[str] = None):
    """``results``: iterable of (name, out, ref, pt) or (name, out, ref, pt, gross).  Checks them
    all, then reports every failure."""
    verdicts = [verdict(*r[:4], dtype, *r[4:]) for r in results]
    bad = [v for v in verdicts if not v.ok]
    if bad:
        lines = [str(v) for v in verdicts]
        if context:
            lines.append(f"case: {context}")
        raise AssertionError("tolerance check failed:\n  " + "\n  ".join(lines))
    return verdicts
