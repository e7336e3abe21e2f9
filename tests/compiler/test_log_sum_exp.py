"""A mixture or a softplus written as a log-prior, or a softplus in a score (docs/priors.md,
"What the scan refuses"): the log of a sum of positive terms with an exponential among them is
computed as a log-sum-exp, as a density's sum is, so it builds and matches the float64
reference far past where its terms leave float32's range, on both paths, with its parameters'
gradients."""
from __future__ import annotations

import re

import pytest
import torch

import bamgen
from tests.helpers import run_cli_in_process, write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

# two Laplace priors, the sharp one underflowing in float32 past |d| = 52 at b1 = 0.5
MIXTURE = """
name: laplace_mixture
log_prior: log(exp(-Abs(d)/b1) + a*exp(-Abs(d)/b2))
params:
  b1: {init: 0.5, domain: positive}
  b2: {init: 8.0, domain: positive}
  a: {init: 0.3, domain: positive}
"""
# a mixture whose weights p and 1 - p come from an interval: SymPy's assumptions know p > 0
# only, so 1 - p was not seen as positive, no log-sum-exp was taken, and the build refused
# the file (the derivative in p was 0/0 where both terms underflow, |d| past 1490 at b = 2)
WEIGHTED = """
name: weighted_mixture
density: p*exp(-Abs(d)/b1)/b1 + (1 - p)*exp(-Abs(d)/b2)/b2
params:
  p: {init: 0.7, domain: [0, 1]}
  b1: {init: 0.5, domain: positive}
  b2: {init: 8.0, domain: positive}
"""
# a softplus penalty per score (it reads i: computed in the kernels, not tabulated), whose
# exp(|d|) overflows float32 at |d| = 89
SOFTPLUS = """
name: softplus_penalty
log_prior: -log(1 + exp(Abs(d)/c)) - Abs(i)/b
params:
  c: {init: 0.5, domain: positive}
  b: {init: 64.0, domain: positive}
"""


def _mixture(d, p):
    return torch.logaddexp(-d.abs() / p["b1"], torch.log(p["a"]) - d.abs() / p["b2"])


def _weighted(d, p):
    return torch.logaddexp(torch.log(p["p"] / p["b1"]) - d.abs() / p["b1"],
                           torch.log((1 - p["p"]) / p["b2"]) - d.abs() / p["b2"])


def _softplus(d, p):
    return -torch.nn.functional.softplus(d.abs() / p["c"]) - p["i"].abs() / p["b"]


CASES = {"mixture": (MIXTURE, dict(b1=[0.5, 0.25], b2=[8.0, 3.0], a=[0.3, 1.5]),
                     _mixture),
         "weighted": (WEIGHTED, dict(p=[0.7, 0.2], b1=[0.5, 0.25], b2=[8.0, 3.0]),
                      _weighted),
         "softplus": (SOFTPLUS, dict(c=[0.5, 0.3], b=[64.0, 9.0]),
                      _softplus)}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lse")
    return {name: bamgen.load(write_prior(folder, text, f"{name}.yaml"), cache_dir=folder / "cache")
            for name, (text, _, _) in CASES.items()}


def test_the_generated_module_computes_a_log_sum_exp(modules):
    """The printed hooks take the largest term out (a Max), where the formula was written with
    none."""
    for module in modules.values():
        assert "max" in open(module.__file__).read().lower()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False])
# (the weighted mixture's second term underflows float32 only past |d| ~ 800: at 3000 its
# weight p's derivative was a 0/0 before the log-sum-exp)
@pytest.mark.parametrize("name, q_offset", [(name, 106) for name in CASES] + [("weighted", 3000)])
def test_it_matches_the_reference_far_past_float32_s_range(modules, name, q_offset, causal,
                                                           backend):
    text, values, log_prior = CASES[name]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (17, 123, 123))
    dout = torch.randn(1, 2, 17, 16, generator=g)
    params = {key: torch.tensor(val) for key, val in values.items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    learn = {key: t.clone().requires_grad_() for key, t in params.items()}
    out = modules[name].attention(*leaves, **learn, causal=causal, q_offset=q_offset,
                                  backend=backend)
    grads = torch.autograd.grad(out, leaves + list(learn.values()), dout)
    kw = dict(causal=causal, dout=dout, q_offset=q_offset)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{key}", grad, ref.dparams[key], pt.dparams[key])
                for key, grad in zip(learn, grads[3:])]
    assert all(bool(torch.isfinite(r).all()) for _, r, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{name} {backend} causal={causal}")


# A score's softplus (what the hint for softplus(s) writes) and stick-breaking's log-sigmoid:
# exp(s) overflows float32 past s = 89, where the log-sum-exp stays finite
SCORES = {
    "softplus_score": ("log(1 + exp(s)) + log_prior", "-Abs(d)/8",
                       lambda s, lp, n, p: torch.nn.functional.softplus(s) + lp,
                       lambda d, p: -d.abs() / 8),
    "log_sigmoid_score": ("-log(1 + exp(-s)) + log_prior", "0",
                          lambda s, lp, n, p: torch.nn.functional.logsigmoid(s) + lp, None),
}


@pytest.fixture(scope="module")
def score_modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lse_score")
    files = {name: write_prior(folder, f"name: {name}\nscore: {score}\nlog_prior: {lp}\n",
                               f"{name}.yaml") for name, (score, lp, _, _) in SCORES.items()}
    return {name: bamgen.load(path, cache_dir=folder / "cache") for name, path in files.items()}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(SCORES))
def test_a_softplus_in_the_score_matches_the_reference_where_exp_s_overflows(score_modules, name,
                                                                             backend):
    """Scores up to a few hundred on either side (q scaled by 60): float32's exp(s) is inf
    there, and the module's output and gradients still match the float64 reference."""
    _, _, score, log_prior = SCORES[name]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (19, 45, 45))
    q = q * 60
    dout = torch.randn(1, 2, 19, 16, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = score_modules[name].attention(*leaves, causal=False, backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)
    kw = dict(causal=False, dout=dout, score=score)
    ref = reference_attention(q, k, v, {}, log_prior, **kw)
    pt = reference_attention(q, k, v, {}, log_prior, compute_dtype=torch.float32, **kw)
    s = (q @ k.transpose(-1, -2)) / 4
    assert float(s.abs().max()) > 200   # (the test reaches where exp(s) overflows float32)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    assert all(bool(torch.isfinite(r).all()) for _, r, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{name} {backend}")


def test_the_hint_for_softplus_in_a_score_gives_a_file_that_builds(tmp_path):
    """softplus(s) is refused with the formula to write instead; the file so rewritten was then
    refused too (its logit +inf at s = 10000), and now builds."""
    text = "name: sp\nscore: softplus(s) + log_prior\nlog_prior: -Abs(d)\n"
    res = run_cli_in_process("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2 and "\n" not in res.stderr.strip(), res.stderr
    written, rewrite = re.search(r"write (softplus\(s\)) as (.+?);", res.stderr).groups()
    fixed = write_prior(tmp_path, text.replace(written, rewrite), "fixed.yaml")
    res = run_cli_in_process("build", str(fixed), "-o", str(tmp_path / "out"))
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "out" / "sp.py").exists()
