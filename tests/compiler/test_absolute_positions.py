"""Priors in the absolute positions i and j (docs/priors.md, "Positions"): built, then run on
both paths against the float64 reference, out and every gradient, a parameter's included."""
from __future__ import annotations

import pytest
import torch

import bamgen
from tests.helpers import write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

# A query at 0 against keys near 2**24 (the far corner of the checked domain), and ordinary ones.
LAYOUTS = {"near": dict(q_offset=5, k_offset=0), "far": dict(q_offset=0, k_offset=2**24 - 40)}


def _check(module, log_prior, params, *, causal, layout, backend, Nq=9, Nk=40, kink=None):
    torch.manual_seed(5)
    B, H, D = 1, 2, 16
    q, k, v, dout = (torch.randn(B, H, n, D) for n in (Nq, Nk, Nk, Nq))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    learnable = module.LEARNABLE
    p_leaves = {n: t.clone().requires_grad_(n in learnable) for n, t in params.items()}
    out = module.attention(*leaves, **p_leaves, causal=causal, backend=backend, **LAYOUTS[layout])
    grads = torch.autograd.grad(out, leaves + [p_leaves[n] for n in learnable], dout)
    kw = dict(causal=causal, dout=dout, kink=kink, **LAYOUTS[layout])
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{n}", g, ref.dparams[n], pt.dparams[n]) for n, g in zip(learnable, grads[3:])]
    assert_all_close(results, torch.float32, context=f"{module.PRIOR['name']} {layout} {backend}")


def _log1p(p, x):
    return torch.log1p(p[x])


# A log-distance prior, scale-invariant (the log of the ratio of the positions), written in
# the forms a user would, and others that read log(1 + i): (formula, reference, kink or None).
LOG_POSITIONS = {
    "logdist": ("-b*Abs(log(1 + i) - log(1 + j))",
                lambda d, p: -p["b"] * torch.abs(_log1p(p, "i") - _log1p(p, "j")),
                lambda d, p: d == 0),
    "ratio": ("-b*Abs(log((1 + i)/(1 + j)))",
              lambda d, p: -p["b"] * torch.abs(_log1p(p, "i") - _log1p(p, "j")),
              lambda d, p: d == 0),
    "squared": ("-b*(log(1 + i) - log(1 + j))**2",
                lambda d, p: -p["b"] * (_log1p(p, "i") - _log1p(p, "j")) ** 2, None),
    "product": ("-b*log(1 + i)*log(1 + j)/16",
                lambda d, p: -p["b"] * _log1p(p, "i") * _log1p(p, "j") / 16, None),
    "apart": ("-c*log(1 + j) + b*log(1 + i)",
              lambda d, p: -p["c"] * _log1p(p, "j") + p["b"] * _log1p(p, "i"), None),
}


@pytest.fixture(scope="module")
def log_modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("log_positions")
    modules = {}
    for name, (formula, _, _) in LOG_POSITIONS.items():
        text = f"""
        name: {name}
        log_prior: {formula}
        params:
          b: {{init: 2.0, domain: positive}}
        """ + ("  c: {init: 0.5, domain: positive}\n" if "c*" in formula else "")
        modules[name] = bamgen.load(write_prior(folder, text, f"{name}.yaml"), cache_dir=folder / "cache")
    return modules


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(LOG_POSITIONS))
def test_log_of_a_position_builds_and_matches_reference(log_modules, name, layout, backend):
    """log(1 + i) was printed as log(d + (j + 1)), the compiler's i = d + j: at d = -2**24,
    j = 2**24 float32 rounds j + 1 to 2**24 and the log's argument to 0, so the build's scan
    found -inf (or +inf) where the user's formula is finite and refused every such prior. The
    module now reads i, as written, and matches the float64 reference near and far."""
    module = log_modules[name]
    assert "i" in module.TRAITS.reads
    _, reference, kink = LOG_POSITIONS[name]
    params = {"b": torch.tensor([2.0, 0.7])}
    if "c" in module.PARAM_NAMES:
        params["c"] = torch.tensor([0.5, 1.5])
    _check(module, reference, params, causal=layout == "near", layout=layout, backend=backend,
           kink=kink)
