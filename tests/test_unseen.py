"""Priors the compiler has never seen, written in the documented language, must build and match
an independent float64 reference on the output and every gradient, on both paths.

The log-priors below are written twice: once as prior-file text for bamgen, once as plain torch
for the reference (tests/reference.py), so a printer or derivative bug cannot hide in both.
"""
import pytest
import torch

import bamgen
from tests.helpers import write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

UNSEEN = {
    # KERPLE-log: a logarithmic tail with two learnable positive parameters.
    "kerple_log_unseen": (
        """
        name: kerple_log_unseen
        log_prior: -r1 * log(1 + r2 * Abs(d))
        params:
          r1: {init: 1.0, domain: positive}
          r2: {init: "0.5 + h/H", domain: positive}
        """,
        lambda d, p: -p["r1"] * torch.log1p(p["r2"] * torch.abs(d)),
        None,
        {"r1": [0.7, 1.3], "r2": [0.2, 2.0]},
    ),
    # A Cauchy density (log taken by the compiler), a square-root tail and a fixed exponent.
    "mixed_density_unseen": (
        """
        name: mixed_density_unseen
        density: exp(-c * sqrt(Abs(d) + 1)) / (1 + (d / w)**2)
        params:
          c: {init: 0.1, domain: nonnegative}
          w: {init: 4.0, domain: positive}
        """,
        lambda d, p: -p["c"] * torch.sqrt(torch.abs(d) + 1) - torch.log1p((d / p["w"]) ** 2),
        None,
        {"c": [0.05, 0.4], "w": [1.5, 9.0]},
    ),
    # GGD with a shape fixed at compile time (beta = 2 must print as x*x) and an offset mode.
    "gaussian_shifted_unseen": (
        """
        name: gaussian_shifted_unseen
        log_prior: -(Abs(d - m) / a) ** beta
        params:
          a: {init: 8.0, domain: positive}
          m: {init: 0.0}
          beta: {value: 2}
        """,
        lambda d, p: -((d - p["m"]) / p["a"]) ** 2,
        None,
        {"a": [3.0, 11.0], "m": [0.0, 2.5]},
    ),
    # SSMax-style scaled softmax: the score multiplies the whole logit by t * log(n).
    "ssmax_unseen": (
        """
        name: ssmax_unseen
        log_prior: -Abs(d) / b
        score: (s + log_prior) * t * log(n)
        params:
          b: {init: 4.0, domain: positive}
          t: {init: 0.5, domain: positive}
        """,
        lambda d, p: -torch.abs(d) / p["b"],
        lambda s, lp, n, p: (s + lp) * p["t"] * torch.log(n.to(s.dtype)),
        {"b": [2.0, 6.0], "t": [0.3, 0.9]},
    ),
}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unseen")
    built = {}
    for name, (text, *_rest) in UNSEEN.items():
        built[name] = bamgen.load(write_prior(folder, text, f"{name}.yaml"), cache_dir=folder / "cache")
    return built


def test_fixed_integer_power_prints_as_a_product(modules):
    source = open(modules["gaussian_shifted_unseen"].__file__).read()
    assert "exp2" not in source.split("def _load_triton")[1].split("def _attn_fwd_inner")[0]
    assert "torch.pow" not in source


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(UNSEEN))
@pytest.mark.parametrize("causal", [True, False])
def test_unseen_prior_matches_reference(modules, name, backend, causal):
    _text, log_prior, score, values = UNSEEN[name]
    module = modules[name]
    torch.manual_seed(7)
    B, Hq, Hk, Nq, Nk, D = 2, 2, 1, 23, 37, 32
    q = torch.randn(B, Hq, Nq, D)
    k = torch.randn(B, Hk, Nk, D)
    v = torch.randn(B, Hk, Nk, D)
    dout = torch.randn(B, Hq, Nq, D)
    params = {n: torch.tensor(vals, dtype=torch.float32) for n, vals in values.items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p_leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    out = module.attention(*leaves, **p_leaves, causal=causal, q_offset=Nk - Nq + 3,
                           backend=backend)
    grads = torch.autograd.grad(out, leaves + list(p_leaves.values()), dout)
    kw = dict(causal=causal, q_offset=Nk - Nq + 3, score=score, dout=dout)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{n}", g, ref.dparams[n], pt.dparams[n]) for n, g in zip(p_leaves, grads[3:])]
    assert all(torch.isfinite(g).all() for _, g, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{name} {backend} causal={causal}")
