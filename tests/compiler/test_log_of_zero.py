"""log(0) in a formula is -oo, the zero of a prior, as `-oo` itself is (docs/priors.md, "The
formula language"): a window written Piecewise((..., Abs(d) <= W), (log(0), True)) was refused
as "not finite (division by zero or log of zero)", though the same window with -oo builds."""
from __future__ import annotations

import pytest
import torch

import bamgen
from tests.helpers import run_cli_in_process, write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

WINDOW = """
name: log_zero_window
log_prior: Piecewise((-Abs(d)/b, Abs(d) <= 8), (log(0), True))
params:
  b: {init: 4.0, domain: positive}
"""


def test_a_window_of_log_0_builds_from_the_command_line(tmp_path):
    res = run_cli_in_process("build", str(write_prior(tmp_path, WINDOW)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "out" / "log_zero_window.py").exists()


def test_minus_log_0_is_plus_infinity_and_refused_as_such(tmp_path):
    """-log(0) is +oo, which no log-prior may be: refused in one line naming +inf, not as a
    log of zero."""
    text = WINDOW.replace("(log(0), True)", "(-log(0), True)")
    res = run_cli_in_process("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "\n" not in line and "field 'log_prior': the log-prior is +inf at d = " in line, line
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("log_zero")
    return bamgen.load(write_prior(folder, WINDOW), cache_dir=folder / "cache")


def _window(d, p):
    return torch.where(d.abs() <= 8, -d.abs() / p["b"], -torch.inf)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_window_matches_the_reference(module, causal, backend):
    """Keys up to 41 tokens away, most outside the window: they get no weight and no
    gradient, as the float64 reference's -inf gives them."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (23, 41, 41))
    dout = torch.randn(1, 2, 23, 16, generator=g)
    params = {"b": torch.tensor([4.0, 0.7])}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    b = params["b"].clone().requires_grad_()
    out = module.attention(*leaves, b=b, causal=causal, q_offset=18, backend=backend)
    grads = torch.autograd.grad(out, leaves + [b], dout)
    kw = dict(causal=causal, dout=dout, q_offset=18)
    ref = reference_attention(q, k, v, params, _window, **kw)
    pt = reference_attention(q, k, v, params, _window, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv),
               ("db", grads[3], ref.dparams["b"], pt.dparams["b"])]
    assert all(bool(torch.isfinite(r).all()) for _, r, _, _ in results)
    assert_all_close(results, torch.float32, context=f"log(0) window {backend} causal={causal}")
