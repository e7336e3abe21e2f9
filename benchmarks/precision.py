"""Precision at extreme positions and parameters: the generated modules against float64.

    .venv/bin/python benchmarks/precision.py                      # both backends, about 1 minute
    .venv/bin/python benchmarks/precision.py --backends torch     # the CPU path only

Run from the repository root or anywhere: it imports generated/ and tests/reference.py of the
checkout it lives in. Without a GPU the Triton kernels run under the Triton interpreter
(TRITON_INTERPRET=1, set here), with the same float32 arithmetic and tiles of the interpreter's
size; with CUDA they run on the GPU.

Every case draws q, k, v and dout (float32, seed 0), runs attention() forward and backward
with the prior parameters as leaves, and reports the largest absolute error against the float64
reference of tests/reference.py (the same float32 inputs, every step in float64), for the
output and every gradient. Beside each backend, `naive-fp32` is that reference's math run in
float32 (the logits materialised, the prior evaluated in float32 from float32 positions, as a
hand-written bias would be): the yardstick of docs/architecture.md, "Testing". Also reported: entries that
are not finite where the reference is ("nonfinite"), rows that came out all zero against the
reference's, and the largest parameter gradient of the reference (where it is 0, the error is
the whole value). The markdown tables go to stdout, one line per row to stderr as it is
measured. The figures are in docs/reliability.md.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # read when the kernels are first defined

import bamgen                                          # noqa: E402
from generated import bam_ssmax, generalized_gaussian, laplace   # noqa: E402
from tests.reference import reference_attention        # noqa: E402


def _ggd(d, p):
    return -(torch.abs(d - p["mu"]) / p["alpha"]) ** p["beta"]


def _laplace(d, p):
    return -torch.abs(d) / p["b"]


def _bam(d, p):
    return -torch.exp(p["ta"]) * (torch.abs(-d - 2 * torch.sinh(p["tm"])) + 1e-5) ** p["tb"]


def _ssmax_score(s, lp, n, p):
    return (s + lp) * p["ssmax"] * torch.log(n.to(s.dtype))


@dataclass(frozen=True)
class Prior:
    label: str
    module: object
    log_prior: object
    kink: object = None
    score: object = None


@dataclass(frozen=True)
class Case:
    name: str
    about: str
    params: dict
    Nq: int = 32
    Nk: int = 32
    q_offset: int = 0
    k_offset: int = 0
    causal: bool = True


@dataclass
class Errors:
    backend: str
    values: dict = field(default_factory=dict)       # "out", "dq", ..., "d<param>" -> max abs error
    magnitudes: dict = field(default_factory=dict)   # the same keys -> max |reference|
    nonfinite: int = 0
    zero_rows: int = 0
    ref_zero_rows: int = 0
    largest_param_grad: float = 0.0


GGD = Prior("generalized_gaussian (table strategy: float64 distance table on the host)",
            generalized_gaussian, _ggd, lambda d, p: (d - p["mu"]) == 0)
GGD_CASES = [
    Case("mu=1e6, non-causal", "the prior's mode a million tokens back: every log-prior is about "
         "-2.5e5 (alpha 4, beta 1), 32 queries and keys", dict(alpha=4.0, beta=1.0, mu=1e6),
         causal=False),
    Case("queries at 2^23, keys 0..2047", "16 queries at positions 2^23.. against keys 0..2047: "
         "distances about 8.4e6 and log-priors about -4.7e7 (alpha 64, beta 1.5), causal",
         dict(alpha=64.0, beta=1.5, mu=0.0), Nq=16, Nk=2048, q_offset=2 ** 23),
    Case("beta=50, mu=100", "a near-box prior (alpha 100, beta 50, mode 100 back): log-priors "
         "between -1 and 0, but (|d - mu|/alpha)^50 spans 1e-100 to 1 within a row and its "
         "derivatives underflow float32; 128 queries and keys, causal",
         dict(alpha=100.0, beta=50.0, mu=100.0), Nq=128, Nk=128),
    Case("every key deep in the tail", "alpha 1, beta 2, mu 500 with distances 0..31: every key "
         "has a log-prior below -2.2e5; the true d/dalpha is 0", dict(alpha=1.0, beta=2.0, mu=500.0)),
    Case("alpha=1e-39", "alpha a float32 denormal (inside the domain): every key but d = 0 has "
         "weight exactly 0", dict(alpha=1e-39, beta=1.0, mu=0.0)),
]
LAPLACE_CASES = [
    Case(f"queries at 2^{e}, keys 0..255", f"16 queries at 2^{e}.. against keys 0..255, b 3.7, "
         f"causal", dict(b=3.7), Nq=16, Nk=256, q_offset=2 ** e)
    for e in (12, 16, 20, 23)
]


SSMAX = Prior("bam_ssmax (logit = (s + log_prior) * ssmax * log n: the score multiplies q.k)",
              bam_ssmax, _bam, score=_ssmax_score)
SSMAX_CASES = [
    Case(f"ssmax={x}, 17 keys", f"ssmax {x}: q.k is multiplied by ssmax * log(17) = "
         f"{x * math.log(17):.3g} (ta -2, tb 1, tm 0), 17 queries and keys, non-causal",
         dict(ta=-2.0, tb=1.0, tm=0.0, ssmax=x), Nq=17, Nk=17, causal=False)
    for x in (0.4, 16.0, 300.0)
]


def _laplace_priors(cache: str):
    """The shipped Laplace module (inline strategy on the GPU: -|d|/b evaluated in float32 in the
    kernels) and the same prior built with --strategy table (float64 distance table), built into
    the folder `cache`."""
    tabled = bamgen.load("laplace", strategy="table", cache_dir=cache)
    kink = lambda d, p: d == 0   # noqa: E731
    return [Prior("laplace, as shipped (inline strategy on the GPU: float32 in the kernels)",
                  laplace, _laplace, kink),
            Prior("laplace built with --strategy table (float64 distance table on the host)",
                  tabled, _laplace, kink)]


def _inputs(case: Case):
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randn(1, 2, n, 16, generator=g)   # noqa: E731
    q, k, v, dout = draw(case.Nq), draw(case.Nk), draw(case.Nk), draw(case.Nq)
    params = {n: torch.tensor([float(x)] * 2) for n, x in case.params.items()}
    return q, k, v, dout, params


def _zero_rows(out) -> int:
    return int((out[0, 0].abs().sum(-1) == 0).sum())


def _compare(backend, got: dict, ref) -> Errors:
    errors = Errors(backend)
    truth = {"out": ref.out, "dq": ref.dq, "dk": ref.dk, "dv": ref.dv,
             **{"d" + n: g for n, g in ref.dparams.items()}}
    for name, value in got.items():
        r = truth[name]
        mine = value.detach().double().cpu()
        finite = torch.isfinite(r)
        errors.nonfinite += int((finite & ~torch.isfinite(mine)).sum())
        diff = torch.where(finite, mine - r, 0.0).abs()
        errors.values[name] = float(torch.where(torch.isnan(diff), math.inf, diff).max())
        errors.magnitudes[name] = float(torch.where(finite, r, 0.0).abs().max())
    errors.zero_rows, errors.ref_zero_rows = _zero_rows(got["out"]), _zero_rows(ref.out)
    errors.largest_param_grad = max((errors.magnitudes[n] for n in got if n.startswith("d")
                                     and n not in ("dq", "dk", "dv")), default=0.0)
    return errors


def run_case(prior: Prior, case: Case, backends: list[str], naive: bool = True) -> list[Errors]:
    """Errors of each backend, then (naive) of the naive float32 math."""
    q, k, v, dout, params = _inputs(case)
    kw = dict(causal=case.causal, q_offset=case.q_offset, k_offset=case.k_offset)
    rkw = dict(kw, kink=prior.kink, score=prior.score, dout=dout)
    learnable = [n for n in params if n in prior.module.LEARNABLE]
    ref = reference_attention(q, k, v, params, prior.log_prior, **rkw)
    rows = []
    for backend in backends:
        device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        p_leaves = {n: t.to(device).requires_grad_(n in learnable) for n, t in params.items()}
        out = prior.module.attention(*leaves, **p_leaves, **kw, backend=backend)
        grads = torch.autograd.grad(out, leaves + [p_leaves[n] for n in learnable], dout.to(device))
        got = dict(zip(["out", "dq", "dk", "dv"] + ["d" + n for n in learnable], [out, *grads]))
        rows.append(_compare(backend, got, ref))
    if naive:
        pt = reference_attention(q, k, v, params, prior.log_prior, compute_dtype=torch.float32, **rkw)
        got = {"out": pt.out, "dq": pt.dq, "dk": pt.dk, "dv": pt.dv,
               **{"d" + n: pt.dparams[n] for n in learnable}}
        rows.append(_compare("naive-fp32", got, ref))
    return rows


def _table(prior: Prior, cases: list[Case], backends: list[str]) -> list[str]:
    grad_names = ["d" + n for n in cases[0].params if n in prior.module.LEARNABLE]
    columns = ["out", "dq", "dk", "dv", *grad_names]
    lines = [f"**{prior.label}**", "",
             "| case | backend | " + " | ".join(columns) + " | nonfinite | zero rows (ref) "
             "| max abs d-param (ref) |",
             "|---|---|" + "---:|" * len(columns) + "---:|---:|---:|"]
    for case in cases:
        for row in run_case(prior, case, backends):
            cells = " | ".join(f"{row.values[c]:.1e}" for c in columns)
            lines.append(f"| {case.name} | {row.backend} | {cells} | {row.nonfinite} | "
                         f"{row.zero_rows} ({row.ref_zero_rows}) | {row.largest_param_grad:.2e} |")
            print(lines[-1], file=sys.stderr, flush=True)   # progress
    return lines + [""]


def _descriptions(cases: list[Case]) -> list[str]:
    return [f"- {case.name}: {case.about}." for case in cases]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="torch,triton",
                    help="comma-separated: torch, triton (default: both)")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if not set(backends) <= {"torch", "triton"}:
        ap.error("--backends takes torch and/or triton")
    torch.set_num_threads(1)
    where = "CUDA" if torch.cuda.is_available() else "the Triton interpreter (TRITON_INTERPRET=1)"
    lines = ["Max abs error against the float64 reference; float32 inputs, B=1, H=2, D=16; "
             f"Triton on {where}.", ""]
    lines += _table(GGD, GGD_CASES, backends) + _descriptions(GGD_CASES) + [""]
    lines += _table(SSMAX, SSMAX_CASES, backends)
    with tempfile.TemporaryDirectory(prefix="bamgen-precision-") as cache:
        for prior in _laplace_priors(cache):
            lines += _table(prior, LAPLACE_CASES, backends)
    lines += _descriptions(LAPLACE_CASES[:1]) + ["- (the other Laplace cases: the same at 2^16, "
                                                 "2^20 and 2^23)."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
