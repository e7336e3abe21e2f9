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
        score: (s + log_prior) * tau * log(n)
        params:
          b: {init: 4.0, domain: positive}
          tau: {init: 0.5, domain: positive}
        """,
        lambda d, p: -torch.abs(d) / p["b"],
        lambda s, lp, n, p: (s + lp) * p["tau"] * torch.log(n.to(s.dtype)),
        {"b": [2.0, 6.0], "tau": [0.3, 0.9]},
    ),
    # Depends on the absolute query position, not only on d: a recency bias whose strength
    # grows with depth into the sequence, plus an exponential tail. Positions are negative
    # with a negative offset (left padding), hence the Abs: log(1 + i) and exp(-j/16) are
    # refused, being nan and beyond float32 there.
    "depth_aware_unseen": (
        """
        name: depth_aware_unseen
        log_prior: -Abs(d) * log(1 + Abs(i)) / w - c * exp(-Abs(j) / 16)
        params:
          w: {init: 8.0, domain: positive}
          c: {init: 0.5}
        """,
        lambda d, p: (-torch.abs(d) * torch.log1p(torch.abs(p["i"])) / p["w"]
                      - p["c"] * torch.exp(-torch.abs(p["j"]) / 16)),
        None,
        {"w": [4.0, 12.0], "c": [0.5, -0.3]},
    ),
    # BAM's own form with a small (and a negative) shape: the epsilon keeps |.|^tb finite at
    # the kink d = -2 sinh(tm), and tm is a buffer.
    "bam_small_beta_unseen": (
        """
        name: bam_small_beta_unseen
        log_prior: -exp(ta) * (Abs(j - i - 2*sinh(tm)) + 1e-5) ** tb
        params:
          ta: {init: -1.0}
          tb: {init: 0.1}
          tm: {init: 0.0, learnable: false}
        """,
        lambda d, p: -torch.exp(p["ta"]) * (torch.abs(-d - 2 * torch.sinh(p["tm"])) + 1e-5) ** p["tb"],
        None,
        {"ta": [-1.0, 0.5], "tb": [0.05, -0.2], "tm": [0.0, 0.0]},
    ),
    # A density that is 0 at d = 0 (a Gamma shape: never attend to yourself): the log-prior's
    # limit there is -oo, kept as the prior's zero, not clamped to a finite value at |d| = 1e-5.
    "gamma_density_unseen": (
        """
        name: gamma_density_unseen
        density: Abs(d)**k1 * exp(-Abs(d)/b)
        params:
          k1: {init: 0.5, domain: positive}
          b: {init: 8.0, domain: positive}
        """,
        lambda d, p: p["k1"] * torch.log(torch.abs(d)) - torch.abs(d) / p["b"],
        None,
        {"k1": [0.5, 2.0], "b": [3.0, 8.0]},
    ),
    # The same shape with a fixed even power, which SymPy writes d**2: its log is 2*log(Abs(d)),
    # not 2*log(d) (nan at d < 0, which once had the build refuse it).
    "even_power_density_unseen": (
        """
        name: even_power_density_unseen
        density: Abs(d)**2 * exp(-Abs(d)/b)
        params:
          b: {init: 8.0, domain: positive}
        """,
        lambda d, p: 2 * torch.log(torch.abs(d)) - torch.abs(d) / p["b"],
        None,
        {"b": [3.0, 8.0]},
    ),
    # A density with a window, 0 beyond it: its log taken per branch, -oo beyond the window.
    "windowed_density_unseen": (
        """
        name: windowed_density_unseen
        density: Piecewise((0, Abs(d) >= 6), (1 / (1 + (d / g)**2), True))
        params:
          g: {init: 2.0, domain: positive}
        """,
        lambda d, p: torch.where(torch.abs(d) >= 6, -torch.inf, -torch.log1p((d / p["g"]) ** 2)),
        None,
        {"g": [1.5, 4.0]},
    ),
    # A mixture of two Gaussians (a weight and two scales learnable): its log is a log-sum-exp,
    # whose terms underflow far from d = 0, where the plain log of the sum was refused (0/0).
    "gaussian_mixture_unseen": (
        """
        name: gaussian_mixture_unseen
        density: exp(-d**2 / (2 * s1**2)) + a * exp(-d**2 / (2 * s2**2))
        params:
          a: {init: 0.1, domain: positive}
          s1: {init: 2.0, domain: positive}
          s2: {init: 50.0, domain: positive}
        """,
        lambda d, p: torch.logaddexp(-d**2 / (2 * p["s1"]**2),
                                     torch.log(p["a"]) - d**2 / (2 * p["s2"]**2)),
        None,
        {"a": [0.1, 2.0], "s1": [2.0, 0.7], "s2": [50.0, 6.0]},
    ),
}
# where a reference gradient is 0 * inf at a kink, which the contract makes 0 (tests/reference.py):
# the Gamma density's d/dk1 = log|d| at d = 0, where P is 0
KINKS = {"gamma_density_unseen": lambda d, p: d == 0}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unseen")
    built = {}
    for name, (text, *_rest) in UNSEEN.items():
        built[name] = bamgen.load(write_prior(folder, text, f"{name}.yaml"), cache_dir=folder / "cache")
    return built


def test_fixed_integer_power_prints_as_a_product(modules):
    source = open(modules["gaussian_shifted_unseen"].__file__).read()
    # a power with a symbolic exponent prints as exp2(e * log2(x)); no template code uses log2
    assert "tl.log2(" not in source
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
    learnable = module.LEARNABLE
    p_leaves = {n: t.clone().requires_grad_(n in learnable) for n, t in params.items()}
    out = module.attention(*leaves, **p_leaves, causal=causal, q_offset=Nk - Nq + 3,
                           backend=backend)
    grads = torch.autograd.grad(out, leaves + [p_leaves[n] for n in learnable], dout)
    kw = dict(causal=causal, q_offset=Nk - Nq + 3, score=score, dout=dout, kink=KINKS.get(name))
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{n}", g, ref.dparams[n], pt.dparams[n]) for n, g in zip(learnable, grads[3:])]
    assert all(torch.isfinite(g).all() for _, g, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{name} {backend} causal={causal}")


def test_shared_parameter_and_domain_maps_in_the_module(tmp_path):
    prior = write_prior(tmp_path, """
        name: shared_params
        log_prior: -r1 * Abs(d) ** r2 - g * Abs(d)
        params:
          r1: {init: 0.5, domain: nonnegative}
          r2: {init: 1.0, domain: [0, 2]}
          g: {init: 0.01, per_head: false}
        """)
    module = bamgen.load(prior, cache_dir=tmp_path / "cache")
    attn = module.SharedParamsAttention(num_heads=4)
    shapes = {n: tuple(p.shape) for n, p in attn.named_parameters()}
    assert shapes == {"raw_r1": (4,), "raw_r2": (4,), "raw_g": (1,)}
    values = attn.prior_params()
    assert torch.allclose(values["r1"], torch.full((4,), 0.5), atol=1e-6)
    assert torch.allclose(values["r2"], torch.ones(4), atol=1e-6)
    with torch.no_grad():
        attn.raw_r2.fill_(50.0)      # the interval map keeps r2 inside (0, 2)
    assert float(attn.prior_params()["r2"].detach().max()) <= 2.0
    q = torch.randn(1, 4, 9, 16)
    attn(q, q, q).sum().backward()
    assert attn.raw_g.grad.shape == (1,) and torch.isfinite(attn.raw_g.grad).all()


def test_infinite_limit_is_clamped_with_a_note(tmp_path):
    # beta may be negative here, so |d - mu|^beta has no finite limit at d = mu.
    prior = write_prior(tmp_path, """
        name: unbounded_shape
        log_prior: -(Abs(d - mu) / alpha) ** beta
        params:
          alpha: {init: 4.0, domain: positive}
          beta: {init: 1.0}
          mu: {init: 0.0}
        """)
    module = bamgen.load(prior, cache_dir=tmp_path / "cache")
    assert any("clamped" in note for note in module.PRIOR["notes"])
    q = torch.randn(1, 2, 7, 16, requires_grad=True)
    beta = torch.tensor([-0.5, 0.5], requires_grad=True)
    out = module.attention(q, q, q, alpha=4.0, beta=beta, mu=0.0)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(beta.grad).all()


# -c |i| deep into a sequence, over one channel (token positions at offsets) and over two (the
# same positions as tensors: i0 the token's, i1 = 0, so that the logits are the one channel's)
DEPTH_PRIORS = {1: "-Abs(d) / b - c * Abs(i)", 2: "-(Abs(d0) + Abs(d1)) / b - c * Abs(i0)"}


def _token_positions_in_channel_0(n, offset):
    """[1, n, 2] positions of n tokens from offset: channel 0 the token's, channel 1 0."""
    at = torch.arange(n, dtype=torch.float32) + offset
    return torch.stack([at, torch.zeros(n)], -1)[None]


@pytest.mark.parametrize("channels", [1, 2])
def test_a_derivative_constant_along_each_row_gives_no_gradient(tmp_path, channels):
    """A log-prior term in the query's position alone (-c |i|) moves every logit of a row alike:
    softmax is blind to it, and c's gradient is exactly 0. Deep into a sequence (i ~ 1e5) its
    derivative -|i| is large, and summed per score in float32 it left rounding of 1e5 * eps times
    the row's dS; the dQ kernel measures such derivatives from the row's own position instead
    (TRAITS.center_grads), so the Triton gradient is 0 exactly (the CPU path sums in float64:
    a few 1e-9). Over two channels it reads d = 0 in every channel; a prior there that read
    i0 but not n was not centred, and c's Triton gradient was -0.01."""
    prior = write_prior(tmp_path, f"""
        name: depth_constant
        positions: {channels}
        log_prior: {DEPTH_PRIORS[channels]}
        params:
          b: {{init: 4.0, domain: positive}}
          c: {{init: 0.001, domain: nonnegative}}
        """)
    module = bamgen.load(prior, cache_dir=tmp_path / "cache")
    assert module.TRAITS.center_grads
    torch.manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, n, 16) for n in (19, 41, 41, 19))
    c = torch.tensor([0.001, 0.0], requires_grad=True)
    b = torch.tensor([4.0, 1.0], requires_grad=True)
    offsets = dict(q_offset=100_000, k_offset=100_000 - 22)
    positions = {}   # (one channel: the offsets place the tokens)
    if channels > 1:
        positions = dict(pos_q=_token_positions_in_channel_0(19, offsets["q_offset"]),
                         pos_k=_token_positions_in_channel_0(41, offsets["k_offset"]))
    ref = reference_attention(q, k, v, {"b": b.detach(), "c": c.detach()},
                              lambda d, p: -torch.abs(d) / p["b"] - p["c"] * torch.abs(p["i"]),
                              causal=True, dout=dout, **offsets)
    for backend in ("torch", "triton"):
        out = module.attention(q, k, v, b=b, c=c, backend=backend, **offsets, **positions)
        dc, db = torch.autograd.grad(out, (c, b), dout)
        if backend == "triton":
            assert torch.equal(dc, torch.zeros_like(dc)), dc
        assert float(dc.abs().max()) < 1e-7, (backend, dc)
        torch.testing.assert_close(db, ref.dparams["b"].float(), rtol=1e-4, atol=1e-6)
