"""Every shipped prior beyond the core three, against a float64 reference written here again in
plain torch (independent of the compiler), on both paths, output and every learnable gradient.
(uniform, laplace and generalized_gaussian are covered in depth by test_properties.py.)"""
import importlib
import math
import os

import pytest
import torch

from bamgen.runtime.triton.tiles import INTERPRET_TILES
from tests.reference import reference_attention
from tests.tolerance import assert_all_close


def _bam(d, p):
    return -torch.exp(p["ta"]) * (torch.abs(-d - 2 * torch.sinh(p["tm"])) + 1e-5) ** p["tb"]


LIBRARY = {
    # name: (log_prior, score, {param: per-head values}, learnable params, kink)
    "bam": (_bam, None,
            {"ta": [-1.0, -3.0, 0.5, -2.0], "tb": [1.0, -0.5, 0.3, 1.7], "tm": [0.0, 0.3, -1.2, 2.0]},
            ("ta", "tb"), None),
    "bam_ssmax": (_bam, lambda s, lp, n, p: (s + lp) * p["ssmax"] * torch.log(n.to(s.dtype)),
                  {"ta": [-1.0, -3.0, 0.5, -2.0], "tb": [1.0, -0.5, 0.3, 1.7],
                   "tm": [0.0, 0.3, -1.2, 2.0], "ssmax": [0.4, 0.2, 0.7, 1.1]},
                  ("ta", "tb", "ssmax"), None),
    "gaussian": (lambda d, p: -(d - p["mu"]) ** 2 / (2 * p["sigma"] ** 2), None,
                 {"sigma": [2.0, 5.0, 9.0, 30.0], "mu": [0.0, 1.5, 3.0, -2.0]}, ("sigma", "mu"), None),
    "cauchy": (lambda d, p: -torch.log1p(((d - p["mu"]) / p["gamma"]) ** 2), None,
               {"gamma": [1.0, 3.0, 8.0, 0.5], "mu": [0.0, 2.0, -1.0, 4.0]}, ("gamma", "mu"), None),
    "kerple_log": (lambda d, p: -p["r1"] * torch.log1p(p["r2"] * torch.abs(d)), None,
                   {"r1": [1.0, 0.5, 2.0, 0.1], "r2": [1.0, 0.2, 3.0, 0.05]}, ("r1", "r2"),
                   lambda d, p: d == 0),
    "kerple_power": (lambda d, p: -p["r1"] * torch.abs(d) ** p["r2"], None,
                     {"r1": [0.5, 0.1, 1.0, 0.05], "r2": [1.0, 0.4, 1.9, 0.1]}, ("r1", "r2"),
                     lambda d, p: d == 0),
}


def test_library_is_all_shipped():
    from bamgen.resources import shipped_priors
    shipped = {p.stem for p in shipped_priors()}
    assert set(LIBRARY) | {"uniform", "laplace", "generalized_gaussian"} == shipped


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_shipped_prior_matches_reference(name, backend):
    _check_against_reference(name, backend)


@pytest.mark.parametrize("dq_tile", [(64, 32, 4, 1), (64, 64, 4, 1)])
def test_ssmax_dq_with_per_tile_parameter_sums(dq_tile, monkeypatch):
    """SSMax's dQ kernel reduces the parameters' sums per key tile where a tile has 2048 scores
    or more (TILE_GRAD_SUMS: sm_90's 64x32), and per score below (the interpreter's default
    32x16 tile, which the other tests run): both paths against the reference."""
    monkeypatch.setitem(INTERPRET_TILES, "bwd_dq", dq_tile)
    _check_against_reference("bam_ssmax", "triton")


# BAMGEN_TEST_DEVICE=cuda (make gpu-check) runs the Triton checks on a GPU, as in
# tests/runtime/test_properties.py; the reference stays float64 on the CPU
DEVICE = torch.device(os.environ.get("BAMGEN_TEST_DEVICE", "cpu"))


def _check_against_reference(name, backend):
    log_prior, score, values, learnable, kink = LIBRARY[name]
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    module = importlib.import_module(f"generated.{name}")
    assert module.LEARNABLE == learnable
    torch.manual_seed(11)
    B, Hq, Hk, Nq, Nk, D = 1, 4, 2, 29, 45, 32
    q, k, v = torch.randn(B, Hq, Nq, D), torch.randn(B, Hk, Nk, D), torch.randn(B, Hk, Nk, D)
    dout = torch.randn(B, Hq, Nq, D)
    params = {n: torch.tensor(vals) for n, vals in values.items()}
    leaves = [t.clone().to(dev).requires_grad_() for t in (q, k, v)]
    p_leaves = {n: t.clone().to(dev).requires_grad_(n in learnable) for n, t in params.items()}
    out = module.attention(*leaves, **p_leaves, causal=True, q_offset=Nk - Nq, backend=backend)
    wrt = leaves + [p_leaves[n] for n in learnable]
    out, *grads = (t.cpu() for t in (out, *torch.autograd.grad(out, wrt, dout.to(dev))))
    kw = dict(causal=True, q_offset=Nk - Nq, score=score, kink=kink, dout=dout)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{n}", g, ref.dparams[n], pt.dparams[n]) for n, g in zip(learnable, grads[3:])]
    assert all(torch.isfinite(g).all() for _, g, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{name} {backend}")


def test_buffers_get_no_gradient():
    bam = importlib.import_module("generated.bam")
    q = torch.randn(1, 2, 5, 16)
    tm = torch.zeros(2, requires_grad=True)
    out = bam.attention(q, q, q, ta=-1.0, tb=1.0, tm=tm)
    assert not out.requires_grad or torch.autograd.grad(out.sum(), tm, allow_unused=True)[0] is None
