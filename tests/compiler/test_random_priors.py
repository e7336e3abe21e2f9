"""Random formulas over the prior language: each either is refused with a SpecError or builds a
module whose output and parameter gradients match the float64 reference (both paths).

Hypothesis draws an expression tree; the tree is rendered twice, as prior-file text for bamgen
and as a plain torch function for the reference, so the two never share a printer.
"""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

import bamgen
from bamgen.errors import SpecError
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

# (prior-file text, torch function of (d, p)) for leaves and operators.
LEAVES = [
    ("d", lambda d, p: d),
    ("a", lambda d, p: p["a"]),
    ("b", lambda d, p: p["b"]),
    ("0.5", lambda d, p: torch.full_like(d, 0.5)),
    ("3", lambda d, p: torch.full_like(d, 3.0)),
]
UNARY = [
    ("-({})", lambda x: -x),
    ("Abs({})", torch.abs),
    ("log(1 + Abs({}))", lambda x: torch.log1p(torch.abs(x))),
    ("sqrt(Abs({}) + 1)", lambda x: torch.sqrt(torch.abs(x) + 1)),
    ("exp(-Abs({})/8)", lambda x: torch.exp(-torch.abs(x) / 8)),
    ("tanh({})", torch.tanh),
    ("atan({})", torch.atan),
    ("erf(({})/4)", lambda x: torch.erf(x / 4)),
    ("(Abs({}) + 1)**a", lambda x: None),   # needs p: handled in _unary
]
BINARY = [
    ("({}) + ({})", lambda x, y: x + y),
    ("({}) - ({})", lambda x, y: x - y),
    ("({}) * ({})", lambda x, y: x * y),
    ("({}) / (1 + Abs({}))", lambda x, y: x / (1 + torch.abs(y))),
    ("Min({}, {})", torch.minimum),
    ("Max({}, {})", torch.maximum),
]


def _leaf():
    return st.sampled_from(LEAVES)


def _extend(children):
    def unary(pair):
        (fmt, fn), (text, f) = pair
        if fmt.endswith("**a"):
            return fmt.format(text), lambda d, p: (torch.abs(f(d, p)) + 1) ** p["a"]
        return fmt.format(text), lambda d, p: fn(f(d, p))

    def binary(triple):
        (fmt, fn), (t1, f1), (t2, f2) = triple
        return fmt.format(t1, t2), lambda d, p: fn(f1(d, p), f2(d, p))

    return st.one_of(st.tuples(st.sampled_from(UNARY), children).map(unary),
                     st.tuples(st.sampled_from(BINARY), children, children).map(binary))


TREES = st.recursive(_leaf(), _extend, max_leaves=6)
PRIOR = """
name: random_prior
log_prior: -({text}) / 4
params:
  a: {{init: 0.7, domain: positive}}
  b: {{init: 1.5, domain: real}}
"""


# No shrinking: each example compiles a module, and a failure already prints its formula.
@settings(max_examples=int(os.environ.get("BAMGEN_RANDOM_PRIORS", "12")), deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tree=TREES, a=st.floats(0.3, 2.0), b=st.floats(-2.0, 2.0),
       backend=st.sampled_from(["torch", "triton"]), causal=st.booleans())
def test_random_prior_builds_and_matches_reference(tmp_path_factory, tree, a, b, backend, causal):
    text, fn = tree
    folder = tmp_path_factory.mktemp("random")
    (folder / "random_prior.yaml").write_text(PRIOR.format(text=text))
    try:
        module = bamgen.load(folder / "random_prior.yaml", cache_dir=folder / "cache")
    except SpecError as err:
        assert "log_prior" in str(err) or "params" in str(err)
        return
    assume(abs(b) > 1e-3)                       # keep clear of kinks of Abs(b*...) at b = 0
    torch.manual_seed(0)
    B, H, Nq, Nk, D = 1, 2, 13, 21, 16
    q, k, v = torch.randn(B, H, Nq, D), torch.randn(B, H, Nk, D), torch.randn(B, H, Nk, D)
    dout = torch.randn(B, H, Nq, D)
    params = {"a": torch.tensor([a, a * 1.3]), "b": torch.tensor([b, -b / 2])}
    log_prior = lambda d, p: -fn(d, p) / 4     # noqa: E731
    kw = dict(causal=causal, q_offset=Nk - Nq, dout=dout)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    tensors = [ref.out, ref.dq, ref.dk, ref.dv, *ref.dparams.values()]
    assume(all(torch.isfinite(t).all() for t in tensors))
    assume(all(t.abs().max() < 1e6 for t in tensors))
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p_leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    out = module.attention(*leaves, **p_leaves, causal=causal, q_offset=Nk - Nq, backend=backend)
    grads = torch.autograd.grad(out, leaves + list(p_leaves.values()), dout)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv),
               ("da", grads[3], ref.dparams["a"], pt.dparams["a"]),
               ("db", grads[4], ref.dparams["b"], pt.dparams["b"])]
    assert_all_close(results, torch.float32, context=f"log_prior = -({text})/4, {backend}")
