"""A kink whose limit hangs on the sign of a parameter the domain leaves open (docs/priors.md,
"Positions"): -Abs(d)**p/b with p real has the limit 0 at d = 0 for p > 0, -1/b for p = 0 and
-oo for p < 0. The value at d = 0 is that limit for the parameter's value at run time, on the
CPU path and on the kernels, and so are the derivatives the backward reads there; a single
clamp to |d| = 1e-5 for every p once gave -|1e-5|**p/b (-0.32 at p = 0.1) and moved the output."""
from __future__ import annotations

import math

import pytest
import torch

import bamgen
from tests.helpers import run_cli_in_process, write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

POWER = """
name: power_{tag}
params:
  b: {{init: 1.0, domain: positive}}
  p: {{init: 1.0{domain}}}
log_prior: -Abs(d)**p/b
"""
DOMAINS = {"real": "", "nonnegative": ", domain: nonnegative", "interval": ", domain: [-1, 2]"}

GAMMA = """
name: gamma_real
params:
  b: {init: 4.0, domain: positive}
  kk: {init: 1.0}
density: Abs(d)**kk*exp(-Abs(d)/b)
"""


@pytest.fixture(scope="module")
def power(tmp_path_factory):
    """The power prior built once per domain of p."""
    built = {}

    def load(domain):
        if domain not in built:
            folder = tmp_path_factory.mktemp(f"power_{domain}")
            text = POWER.format(tag=domain, domain=DOMAINS[domain])
            built[domain] = bamgen.load(write_prior(folder, text), cache_dir=folder / "cache")
        return built[domain]
    return load


@pytest.fixture(scope="module")
def gamma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gamma")
    return bamgen.load(write_prior(folder, GAMMA), cache_dir=folder / "cache")


def _power_limit(p: float, b: float) -> float:
    """-|d|**p/b at d -> 0+."""
    return 0.0 if p > 0 else -1.0 / b if p == 0 else -math.inf


@pytest.mark.parametrize("domain, p", [
    ("real", 1.0), ("real", 0.5), ("real", 0.1), ("real", 0.0), ("real", -0.5),
    ("nonnegative", 0.1), ("nonnegative", 0.0), ("interval", 0.1), ("interval", -0.5)])
def test_the_value_at_the_kink_is_the_limit_for_the_sign_of_p(power, domain, p):
    module, b = power(domain), 2.0
    d = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    got = module.log_prior_at(d, b=b, p=p, num_heads=1).flatten().tolist()
    assert got == pytest.approx([_power_limit(p, b), -1.0 / b, -(2.0 ** p) / b], rel=1e-6, abs=1e-12)


def test_the_notes_say_what_each_sign_gives(power):
    notes = power("real").PRIOR["notes"]
    logit = next(n for n in notes if n.startswith("the logit:"))
    assert ("depends on the sign of p: for p > 0 its limit s; for p = 0 its limit s - 1/b; "
            "for p < 0 its limit -oo (a zero of the prior)") in logit, notes
    nonnegative = next(n for n in power("nonnegative").PRIOR["notes"] if n.startswith("the logit:"))
    assert "p > 0" in nonnegative and "p = 0" in nonnegative and "p < 0" not in nonnegative


def _inputs(heads=2, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, heads, n, 16, generator=g) for _ in range(4))
    return q, k, v, dout


def _compare(module, params, log_prior, backend, skip_grads=()):
    """Output and every gradient of a causal call (each row holds d = 0) against the float64
    reference, in FlashAttention's tolerance."""
    q, k, v, dout = _inputs(heads=len(next(iter(params.values()))))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    theta = {name: value.clone().requires_grad_() for name, value in params.items()}
    out = module.attention(*leaves, **theta, causal=True, backend=backend)
    grads = torch.autograd.grad(out, leaves + list(theta.values()), dout)
    kw = dict(causal=True, dout=dout)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{name}", g, ref.dparams[name], pt.dparams[name])
                for name, g in zip(params, grads[3:]) if name not in skip_grads]
    assert all(torch.isfinite(r).all() for _, r, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{backend} {params}")


def _power_log_prior(d, p):
    return -torch.abs(d) ** p["p"] / p["b"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("p", [(1.0, 0.5), (0.1, 0.3), (-0.5, 1.5)])
def test_power_attention_and_its_gradients_match_the_reference(power, backend, p):
    params = {"b": torch.tensor([1.0, 0.7]), "p": torch.tensor(p)}
    _compare(power("real"), params, _power_log_prior, backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_power_at_p_zero_matches_the_reference(power, backend):
    """p = 0: the prior is exp(-1/b) at every distance, d = 0 included. Its derivative in p
    has no value at d = 0 (the log-prior jumps from -1/b to 0 as p leaves 0), so dp is not
    compared; db is, 1/b**2 there."""
    params = {"b": torch.tensor([1.0, 0.7]), "p": torch.tensor([0.0, 0.0])}
    _compare(power("real"), params, _power_log_prior, backend, skip_grads=("p",))


def _gamma_log_prior(d, p):
    return torch.xlogy(p["kk"], torch.abs(d)) - torch.abs(d) / p["b"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kk", [(1.0, 0.5), (0.0, 2.0)])
def test_a_density_that_is_zero_at_d_zero_never_attends_there(gamma, backend, kk):
    """|d|**kk*exp(-|d|/b) is 0 at d = 0 for kk > 0: causal row 0, whose only key is d = 0,
    sees nothing (output 0), and no other row gives d = 0 weight; at kk = 0 it is exp(-|d|/b)."""
    params = {"b": torch.tensor([4.0, 2.0]), "kk": torch.tensor(kk)}
    _compare(gamma, params, _gamma_log_prior, backend)


@pytest.fixture(scope="module")
def two_powers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    text = ("name: two_powers\nparams:\n  p: {init: 1.0}\n  c: {init: 0.5}\n"
            "log_prior: -Abs(d)**p - Abs(d)**c\n")
    return bamgen.load(write_prior(folder, text), cache_dir=folder / "cache")


@pytest.mark.parametrize("p, c, at_zero", [(0.5, 0.2, 0.0), (0.5, 0.0, -1.0), (0.0, 0.0, -2.0),
                                           (0.3, -0.5, -math.inf)])
def test_two_parameters_of_open_sign_are_split_together(two_powers, p, c, at_zero):
    d = torch.tensor([0.0, 4.0], dtype=torch.float64)
    got = two_powers.log_prior_at(d, p=p, c=c, num_heads=1).flatten().tolist()
    assert got == pytest.approx([at_zero, -(4.0 ** p) - 4.0 ** c], rel=1e-6, abs=1e-12)


def test_a_kink_hanging_on_three_signs_is_clamped_with_a_note(tmp_path):
    text = ("name: three_powers\nparams:\n  p: {init: 1.0}\n  c: {init: 0.5}\n  t: {init: 0.5}\n"
            "log_prior: -Abs(d)**p - Abs(d)**c - Abs(d)**t\n")
    module = bamgen.load(write_prior(tmp_path, text), cache_dir=tmp_path / "cache")
    logit = next(n for n in module.PRIOR["notes"] if n.startswith("the logit:"))
    assert "depends on the signs of c, p, t, more than 2 parameters" in logit
    assert "clamped to |d| = 1e-05" in logit


def test_kinks_whose_split_would_outgrow_the_formula_build_clamped_as_before(tmp_path):
    """Two kinks, each with an exponent of its own: taken by sign, the second kink's formula
    grows past its size limit; the build falls back to one clamp per kink, as before the split
    existed (it was refused), and its notes say so."""
    text = ("name: k8\nparams:\n  b: {init: 1.0, domain: positive}\n  p: {init: 1.0}\n"
            "  r: {init: 1.0}\nlog_prior: -(Abs(d)**p + Abs(d - 2)**r)/b\n")
    prior = write_prior(tmp_path, text)
    shown = run_cli_in_process("show", str(prior))   # (show plans as a build does)
    assert shown.exit_code == 0 and "outgrew its limits" in shown.output, shown.output
    module = bamgen.load(prior, cache_dir=tmp_path / "cache")
    logit = next(n for n in module.PRIOR["notes"] if n.startswith("the logit:"))
    assert "outgrew its limits" in logit and "clamped to |d| = 1e-05" in logit
    d = torch.tensor([0.0, 1.0, 2.0, 3.0])
    got = module.log_prior_at(d, b=1.0, p=1.0, r=1.0, num_heads=1).flatten().tolist()
    assert got == pytest.approx([-(1e-5 + 2.0), -2.0, -(2.0 + 1e-5), -4.0], rel=1e-6)
