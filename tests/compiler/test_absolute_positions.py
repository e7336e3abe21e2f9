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


def _check(module, log_prior, params, *, causal, layout, backend, Nq=9, Nk=40, kink=None,
           positions=False):
    """out and the gradients of q, k, v and every learnable parameter (with positions, float
    position tensors, a learnt warp of the token positions, and theirs) against the reference."""
    g = torch.Generator().manual_seed(5)
    B, H, D = 1, 2, 16
    q, k, v, dout = (torch.randn(B, H, n, D, generator=g) for n in (Nq, Nk, Nk, Nq))
    tensors = [q, k, v]
    layout_kw = dict(LAYOUTS[layout])
    if positions:
        pos_k = (0.5 + torch.rand(B, H, Nk, generator=g)).cumsum(-1)
        pos_q = pos_k[..., Nk - Nq:] + 0.25 * torch.rand(B, H, Nq, generator=g)
        tensors += [pos_q, pos_k]
        layout_kw = {}
    leaves = [t.clone().requires_grad_() for t in tensors]
    learnable = module.LEARNABLE
    p_leaves = {n: t.clone().requires_grad_(n in learnable) for n, t in params.items()}
    pos_kw = dict(pos_q=leaves[3], pos_k=leaves[4]) if positions else {}
    out = module.attention(*leaves[:3], **p_leaves, causal=causal, backend=backend, **layout_kw,
                           **pos_kw)
    grads = torch.autograd.grad(out, leaves + [p_leaves[n] for n in learnable], dout)
    kw = dict(causal=causal, dout=dout, kink=kink, **layout_kw)
    if positions:
        kw["positions"] = (pos_q, pos_k)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    if positions:
        results += [("dpos_q", grads[3], ref.dpos_q, pt.dpos_q),
                    ("dpos_k", grads[4], ref.dpos_k, pt.dpos_k)]
    results += [(f"d{n}", gr, ref.dparams[n], pt.dparams[n])
                for n, gr in zip(learnable, grads[len(tensors):])]
    assert all(torch.isfinite(r[1]).all() for r in results)
    context = f"{module.PRIOR['name']} {'positions' if positions else layout} {backend}"
    assert_all_close(results, torch.float32, context=context)


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


def _sqrt(p, x):
    return torch.sqrt(p[x])


# Abs of a difference of square roots of the positions (and the Abs SymPy differentiates alike,
# a root against a constant): (formula, reference)
SQRT_GAPS = {
    "sqrt_gap": ("-b*Abs(sqrt(i) - sqrt(j))",
                 lambda d, p: -p["b"] * torch.abs(_sqrt(p, "i") - _sqrt(p, "j"))),
    "sqrt_gap1": ("-b*Abs(sqrt(1 + i) - sqrt(1 + j))",
                  lambda d, p: -p["b"] * torch.abs(torch.sqrt(1 + p["i"]) - torch.sqrt(1 + p["j"]))),
    "sqrt_level": ("-b*Abs(sqrt(i) - 2) - Abs(d)/8",
                   lambda d, p: -p["b"] * torch.abs(_sqrt(p, "i") - 2) - torch.abs(d) / 8),
}


@pytest.fixture(scope="module")
def sqrt_modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sqrt_positions")
    return {name: bamgen.load(write_prior(folder, f"""
        name: {name}
        log_prior: {formula}
        params:
          b: {{init: 2.0, domain: positive}}
        """, f"{name}.yaml"), cache_dir=folder / "cache") for name, (formula, _) in SQRT_GAPS.items()}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("positions", [False, True], ids=["tokens", "tensors"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "both_sides"])
@pytest.mark.parametrize("name", list(SQRT_GAPS))
def test_abs_of_a_root_of_positions_builds_and_matches_reference(sqrt_modules, name, causal,
                                                                  positions, backend):
    """Positions are real but not nonnegative to SymPy (a position tensor may be negative), so
    sqrt(i) - sqrt(j) may be complex to it, and it differentiated the Abs through the real and
    imaginary parts, atan2 included, which no printer translates: an internal error. The
    printed code computes the Abs's argument in real arithmetic, and the scan refuses a formula
    that is nan where its logit is defined, so the derivative is sign(u) du; the module
    matches the float64 reference with keys on both sides of the kink, the gradients of b and
    of position tensors included. (Near the positions' origin: at i = 0, j = 2**24 the
    log-prior is -8192, computed per score in float32 as docs/reliability.md says.)"""
    _check(sqrt_modules[name], SQRT_GAPS[name][1], {"b": torch.tensor([2.0, 0.7])},
           causal=causal, layout="near", backend=backend, positions=positions,
           kink=lambda d, p: d == 0)
