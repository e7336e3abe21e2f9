"""Checks that the naive reference (tests/reference.py) and the tolerance check are right.

The reference is checked against things that do not share its code: torch's own
``scaled_dot_product_attention`` (zero prior; an explicit additive float bias for an ALiBi-like
prior, including the gradient of the slope through the bias), float64 finite differences, and a
closed-form parameter gradient written out by hand (for the kink convention).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.reference import positions, reference_attention
from tests.tolerance import ATOL, assert_all_close, atol_for, verdict

F64 = torch.float64


def _rand(*shape, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def laplace_lp(d, p):
    return -torch.abs(d) / p["b"]


def ggd_lp(d, p):
    return -(torch.abs(d - p["mu"]) / p["alpha"]) ** p["beta"]


def ggd_kink(d, p):
    return (d - p["mu"]) == 0


def _sdpa(q, k, v, mask, scale=None):
    hq, hk = q.shape[1], k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hk)


# --------------------------------------------------------------------------------------------
# zero prior against SDPA


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("nq,nk,q_offset,k_offset", [
    (17, 17, 0, 0),
    (1, 1, 0, 0),
    (5, 23, 18, 0),    # decode-like, bottom-right aligned
    (23, 9, 0, 0),     # Nq > Nk
    (9, 23, 3, 1),     # arbitrary offsets, every row still sees a key
])
def test_zero_prior_matches_sdpa(causal, hq, hk, nq, nk, q_offset, k_offset):
    b, dim = 2, 8
    q, k, v = _rand(b, hq, nq, dim, seed=1), _rand(b, hk, nk, dim, seed=2), _rand(b, hk, nk, dim, seed=3)
    dout = _rand(b, hq, nq, dim, seed=4)
    _, visible, n = positions(nq, nk, q_offset, k_offset, causal)
    assert (n > 0).all()

    ref = reference_attention(q, k, v, {}, None, causal=causal, q_offset=q_offset, k_offset=k_offset, dout=dout)

    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    if causal and nq == nk and q_offset == k_offset:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=hq != hk)
    else:
        out = _sdpa(qs, ks, vs, visible if causal else None)
    dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout)
    for name, a, r in [("out", out, ref.out), ("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)]:
        torch.testing.assert_close(r, a, rtol=1e-10, atol=1e-10, msg=name)


def test_zero_prior_custom_scale():
    q, k, v = _rand(1, 2, 7, 16, seed=5), _rand(1, 2, 11, 16, seed=6), _rand(1, 2, 11, 16, seed=7)
    ref = reference_attention(q, k, v, {}, None, causal=False, scale=0.37)
    torch.testing.assert_close(ref.out, _sdpa(q, k, v, None, scale=0.37), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# ALiBi-like prior against SDPA with an explicit float bias (grad of b through the bias)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("nq,nk,q_offset,k_offset", [(19, 19, 0, 0), (3, 30, 27, 0), (30, 12, 4, 2), (1, 1, 0, 0)])
def test_laplace_matches_sdpa_float_bias(causal, hq, hk, nq, nk, q_offset, k_offset):
    bsz, dim = 2, 16
    q, k, v = _rand(bsz, hq, nq, dim, seed=11), _rand(bsz, hk, nk, dim, seed=12), _rand(bsz, hk, nk, dim, seed=13)
    dout = _rand(bsz, hq, nq, dim, seed=14)
    b = torch.tensor([2 ** (8 * (h + 1) / hq) for h in range(hq)], dtype=F64) * 0.25  # ALiBi 1/slope, scaled
    ref = reference_attention(q, k, v, {"b": b}, laplace_lp, causal=causal, q_offset=q_offset,
                              k_offset=k_offset, dout=dout)

    d, visible, n = positions(nq, nk, q_offset, k_offset, causal)
    assert (n > 0).all()
    qs, ks, vs, bs = (t.clone().requires_grad_() for t in (q, k, v, b))
    bias = -d.abs()[None] / bs[:, None, None]  # [Hq, Nq, Nk]
    bias = torch.where(visible, bias, torch.tensor(float("-inf"), dtype=F64))
    out = _sdpa(qs, ks, vs, bias[None])
    dq, dk, dv, db = torch.autograd.grad(out, (qs, ks, vs, bs), dout)
    for name, a, r in [("out", out, ref.out), ("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv),
                       ("db", db, ref.dparams["b"])]:
        torch.testing.assert_close(r, a, rtol=1e-10, atol=1e-10, msg=name)


# --------------------------------------------------------------------------------------------
# finite differences (float64) at non-kink points


def _loss(q, k, v, params, lp, dout, **kw):
    return (reference_attention(q, k, v, params, lp, **kw).out * dout).sum().item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_offset,k_offset", [(0, 0), (6, 0), (0, 4)])
def test_ggd_param_grads_match_finite_differences(causal, q_offset, k_offset):
    bsz, hq, hk, nq, nk, dim = 2, 3, 1, 9, 13, 8
    q, k, v = _rand(bsz, hq, nq, dim, seed=21), _rand(bsz, hk, nk, dim, seed=22), _rand(bsz, hk, nk, dim, seed=23)
    dout = _rand(bsz, hq, nq, dim, seed=24)
    # non-integer mu: d == mu never happens; beta on both sides of 1.
    params = {
        "alpha": torch.tensor([0.9, 3.0, 7.5], dtype=F64),
        "beta": torch.tensor([0.3, 1.0, 1.7], dtype=F64),
        "mu": torch.tensor([0.37, -2.6, 4.25], dtype=F64),
    }
    kw = dict(causal=causal, q_offset=q_offset, k_offset=k_offset)
    ref = reference_attention(q, k, v, params, ggd_lp, kink=ggd_kink, dout=dout, **kw)
    eps = 1e-6
    for name in params:
        for h in range(hq):
            plus = {n: t.clone() for n, t in params.items()}
            minus = {n: t.clone() for n, t in params.items()}
            plus[name][h] += eps
            minus[name][h] -= eps
            fd = (_loss(q, k, v, plus, ggd_lp, dout, **kw) - _loss(q, k, v, minus, ggd_lp, dout, **kw)) / (2 * eps)
            got = ref.dparams[name][h].item()
            assert math.isfinite(got)
            assert abs(got - fd) <= 1e-6 * max(1.0, abs(fd)), (name, h, got, fd)

    # dq / dk / dv at a few entries
    for tname, t, g in [("q", q, ref.dq), ("k", k, ref.dk), ("v", v, ref.dv)]:
        for idx in [(0, 0, 0, 0), (1, t.shape[1] - 1, t.shape[2] - 1, dim - 1), (1, 0, t.shape[2] // 2, 3)]:
            tp, tm = t.clone(), t.clone()
            tp[idx] += eps
            tm[idx] -= eps
            args_p = {"q": q, "k": k, "v": v, tname: tp}
            args_m = {"q": q, "k": k, "v": v, tname: tm}
            fd = (_loss(args_p["q"], args_p["k"], args_p["v"], params, ggd_lp, dout, **kw)
                  - _loss(args_m["q"], args_m["k"], args_m["v"], params, ggd_lp, dout, **kw)) / (2 * eps)
            assert abs(g[idx].item() - fd) <= 1e-6 * max(1.0, abs(fd)), (tname, idx, g[idx].item(), fd)


def test_score_callable_matches_finite_differences():
    """An SSMax-like score, (s + lp) * c * log(n), exercises the score path and n."""
    def score(s, lp, n, p):
        return (s + lp) * p["c"] * torch.log(n)

    bsz, hq, nq, nk, dim = 1, 2, 7, 7, 8
    q, k, v = _rand(bsz, hq, nq, dim, seed=31), _rand(bsz, hq, nk, dim, seed=32), _rand(bsz, hq, nk, dim, seed=33)
    dout = _rand(bsz, hq, nq, dim, seed=34)
    params = {"b": torch.tensor([1.5, 4.0], dtype=F64), "c": torch.tensor([0.8, 1.3], dtype=F64)}
    kw = dict(causal=True, q_offset=2, k_offset=0, score=score)
    ref = reference_attention(q, k, v, params, laplace_lp, dout=dout, **kw)
    # n for row i is i + q_offset + 1 (all keys of this causal case start at 0)
    _, _, n = positions(nq, nk, 2, 0, True)
    assert n.tolist() == [3, 4, 5, 6, 7, 7, 7]
    eps = 1e-6
    for name in params:
        for h in range(hq):
            plus = {n_: t.clone() for n_, t in params.items()}
            minus = {n_: t.clone() for n_, t in params.items()}
            plus[name][h] += eps
            minus[name][h] -= eps
            fd = (_loss(q, k, v, plus, laplace_lp, dout, **kw) - _loss(q, k, v, minus, laplace_lp, dout, **kw)) / (2 * eps)
            assert abs(ref.dparams[name][h].item() - fd) <= 1e-6 * max(1.0, abs(fd))


# --------------------------------------------------------------------------------------------
# the kink convention, against a closed form written out by hand


def _closed_form_ggd_grads(q, k, v, dout, params, causal, q_offset, k_offset):
    """dL/dtheta = sum dS * dlogit/dtheta with the contract's conventions spelt out explicitly."""
    bsz, hq, nq, dim = q.shape
    hk, nk = k.shape[1], k.shape[2]
    kx, vx = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    d, visible, n = positions(nq, nk, q_offset, k_offset, causal)
    a, b, m = (params[x].reshape(hq, 1, 1) for x in ("alpha", "beta", "mu"))
    r = d[None] - m  # argument of the Abs
    x = r.abs() / a
    lp = -(x ** b)
    logit = q @ kx.transpose(-1, -2) / math.sqrt(dim) + lp
    logit = logit.masked_fill(~visible, float("-inf"))
    p = torch.softmax(logit, -1).nan_to_num(0.0)  # rows without keys -> 0 (none in the cases used)
    dp = dout @ vx.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    ds = ds.sum(0)  # over batch -> [Hq, Nq, Nk]
    at_kink = r == 0
    safe_x = torch.where(at_kink, torch.ones_like(x), x)
    sign = torch.sign(r)
    dl_dmu = torch.where(at_kink, 0.0, b / a * safe_x ** (b - 1) * sign)
    dl_dalpha = b / a * x ** b
    dl_dbeta = torch.where(at_kink, 0.0, -(safe_x ** b) * torch.log(safe_x))
    out = {}
    for name, g in [("alpha", dl_dalpha), ("beta", dl_dbeta), ("mu", dl_dmu)]:
        out[name] = torch.where(visible, ds * g, 0.0).sum((1, 2))
    return out


@pytest.mark.parametrize("beta", [0.3, 1.0, 2.5, 0.05])
@pytest.mark.parametrize("causal", [False, True])
def test_kink_convention_matches_closed_form(beta, causal):
    bsz, hq, nq, nk, dim = 2, 3, 11, 11, 8
    q, k, v = _rand(bsz, hq, nq, dim, seed=41), _rand(bsz, hq, nk, dim, seed=42), _rand(bsz, hq, nk, dim, seed=43)
    dout = _rand(bsz, hq, nq, dim, seed=44)
    # integer mu -> d == mu occurs on the visible part (causal: d >= 0) for every head
    params = {
        "alpha": torch.tensor([1.0, 2.5, 40.0], dtype=F64),
        "beta": torch.full((hq,), beta, dtype=F64),
        "mu": torch.tensor([0.0, 2.0, 5.0], dtype=F64),
    }
    ref = reference_attention(q, k, v, params, ggd_lp, kink=ggd_kink, causal=causal, dout=dout)
    closed = _closed_form_ggd_grads(q, k, v, dout, params, causal, 0, 0)
    for name in params:
        assert torch.isfinite(ref.dparams[name]).all(), name
        torch.testing.assert_close(ref.dparams[name], closed[name], rtol=1e-10, atol=1e-10, msg=name)


def test_kink_with_beta_above_one_matches_finite_differences():
    """For beta > 1 the prior is differentiable at d == mu and the convention is the true value."""
    bsz, hq, nq, nk, dim = 1, 2, 8, 8, 4
    q, k, v = _rand(bsz, hq, nq, dim, seed=51), _rand(bsz, hq, nk, dim, seed=52), _rand(bsz, hq, nk, dim, seed=53)
    dout = _rand(bsz, hq, nq, dim, seed=54)
    params = {"alpha": torch.tensor([1.5, 3.0], dtype=F64), "beta": torch.tensor([1.5, 2.0], dtype=F64),
              "mu": torch.tensor([1.0, 3.0], dtype=F64)}
    ref = reference_attention(q, k, v, params, ggd_lp, kink=ggd_kink, causal=True, dout=dout)
    eps = 1e-6
    for h in range(hq):
        plus = {n: t.clone() for n, t in params.items()}
        minus = {n: t.clone() for n, t in params.items()}
        plus["mu"][h] += eps
        minus["mu"][h] -= eps
        fd = (_loss(q, k, v, plus, ggd_lp, dout, causal=True) - _loss(q, k, v, minus, ggd_lp, dout, causal=True)) / (2 * eps)
        assert abs(ref.dparams["mu"][h].item() - fd) <= 1e-6 * max(1.0, abs(fd))


def test_nan_is_only_excused_at_declared_kinks():
    """A NaN contribution that is not at a declared kink (nor masked) must survive."""
    def lp(d, p):  # d/dc of -sqrt(c) * |d| at c = 0 is -inf * |d|: NaN at d == 0, -inf elsewhere
        return -torch.sqrt(p["c"]) * torch.abs(d)

    q, k, v = _rand(1, 1, 4, 4, seed=61), _rand(1, 1, 4, 4, seed=62), _rand(1, 1, 4, 4, seed=63)
    dout = _rand(1, 1, 4, 4, seed=64)
    res = reference_attention(q, k, v, {"c": 0.0}, lp, causal=True, dout=dout)
    assert not torch.isfinite(res.dparams["c"]).all()
    res = reference_attention(q, k, v, {"c": 0.0}, lp, causal=True, dout=dout, kink=lambda d, p: d == 0)
    assert not torch.isfinite(res.dparams["c"]).all()  # the -inf elsewhere is not excused either


def test_masked_nan_is_excused():
    """log of a negative distance is NaN at masked (causal, d < 0) positions: never seen."""
    def lp(d, p):
        return -p["b"] * torch.log1p(d)

    q, k, v = _rand(1, 2, 6, 4, seed=71), _rand(1, 2, 6, 4, seed=72), _rand(1, 2, 6, 4, seed=73)
    dout = _rand(1, 2, 6, 4, seed=74)
    res = reference_attention(q, k, v, {"b": torch.tensor([0.5, 1.5])}, lp, causal=True, dout=dout)
    for t in (res.out, res.dq, res.dk, res.dv, res.dparams["b"]):
        assert torch.isfinite(t).all()


# --------------------------------------------------------------------------------------------
# rows with no visible key


@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 1)])
def test_empty_rows_are_zero_and_do_not_contribute(hq, hk):
    bsz, nq, nk, dim, q_offset, k_offset = 2, 9, 7, 8, 0, 5  # rows 0..4 see nothing
    q, k, v = _rand(bsz, hq, nq, dim, seed=81), _rand(bsz, hk, nk, dim, seed=82), _rand(bsz, hk, nk, dim, seed=83)
    dout = _rand(bsz, hq, nq, dim, seed=84)
    params = {"alpha": torch.linspace(1, 4, hq, dtype=F64), "beta": torch.full((hq,), 0.3, dtype=F64),
              "mu": torch.full((hq,), -5.0, dtype=F64)}  # d == mu only at masked/empty positions
    res = reference_attention(q, k, v, params, ggd_lp, kink=ggd_kink, causal=True, q_offset=q_offset,
                              k_offset=k_offset, dout=dout)
    assert res.empty_rows.tolist() == [[True] * 5 + [False] * 4] * bsz
    assert (res.out[:, :, :5] == 0).all()
    assert (res.dq[:, :, :5] == 0).all()
    for t in (res.out, res.dq, res.dk, res.dv, *res.dparams.values()):
        assert torch.isfinite(t).all()
    # same as attending with only the non-empty rows
    sub = reference_attention(q[:, :, 5:], k, v, params, ggd_lp, kink=ggd_kink, causal=True, q_offset=q_offset + 5,
                              k_offset=k_offset, dout=dout[:, :, 5:])
    torch.testing.assert_close(res.out[:, :, 5:], sub.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.dk, sub.dk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.dv, sub.dv, rtol=1e-12, atol=1e-12)
    for name in params:
        torch.testing.assert_close(res.dparams[name], sub.dparams[name], rtol=1e-12, atol=1e-12)


def test_all_rows_empty():
    q, k, v = _rand(1, 1, 3, 4, seed=91), _rand(1, 1, 5, 4, seed=92), _rand(1, 1, 5, 4, seed=93)
    res = reference_attention(q, k, v, {"b": 2.0}, laplace_lp, causal=True, q_offset=0, k_offset=10,
                              dout=_rand(1, 1, 3, 4, seed=94))
    for t in (res.out, res.dq, res.dk, res.dv, res.dparams["b"]):
        assert (t == 0).all()


# --------------------------------------------------------------------------------------------
# pt (the same math in the test dtype) and the tolerance check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pt_runs_in_test_dtype_and_is_close(dtype):
    bsz, hq, hk, nq, nk, dim = 2, 4, 2, 33, 40, 32
    q, k, v = (_rand(bsz, h, n, dim, seed=s, dtype=dtype) for h, n, s in [(hq, nq, 101), (hk, nk, 102), (hk, nk, 103)])
    dout = _rand(bsz, hq, nq, dim, seed=104, dtype=dtype)
    params = {"alpha": torch.tensor([1.0, 3.0, 10.0, 50.0]), "beta": torch.tensor([0.3, 1.0, 1.5, 2.0]),
              "mu": torch.tensor([0.0, 2.0, -1.0, 0.5])}
    kw = dict(causal=True, q_offset=7, k_offset=0, kink=ggd_kink, dout=dout)
    ref = reference_attention(q, k, v, params, ggd_lp, **kw)
    pt = reference_attention(q, k, v, params, ggd_lp, compute_dtype=dtype, **kw)
    assert ref.out.dtype == F64 and pt.out.dtype == dtype and pt.dq.dtype == dtype
    assert all(g.dtype == torch.float32 for g in pt.dparams.values())
    rel = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    for name, a, r in [("out", pt.out, ref.out), ("dq", pt.dq, ref.dq), ("dk", pt.dk, ref.dk), ("dv", pt.dv, ref.dv)]:
        err = (a.double() - r).abs().max().item()
        assert 0 < err <= rel * max(1.0, r.abs().max().item()), (name, err)
    for name in params:
        r = ref.dparams[name]
        err = (pt.dparams[name].double() - r).abs().max().item()
        assert err <= rel * max(1.0, r.abs().max().item()), (name, err)
    # pt passes its own check; ref against itself passes; a perturbed result fails.
    assert_all_close([("out", pt.out, ref.out, pt.out)], dtype)
    bad = pt.out.double() + 3 * (pt.out.double() - ref.out).abs().max() + 2 * atol_for(dtype, ref.out)
    assert not verdict("out", bad, ref.out, pt.out, dtype).ok


def test_tolerance_rejects_nan_and_shape_mismatch():
    ref = torch.zeros(3, dtype=F64)
    pt = torch.zeros(3)
    assert not verdict("x", torch.tensor([0.0, float("nan"), 0.0]), ref, pt, torch.float32).ok
    assert verdict("x", torch.full((3,), 0.5 * ATOL[torch.float32]), ref, pt, torch.float32).ok
    assert not verdict("x", torch.full((3,), 2 * ATOL[torch.float32]), ref, pt, torch.float32).ok
    with pytest.raises(AssertionError):
        verdict("x", torch.zeros(4), ref, pt, torch.float32)


@pytest.mark.parametrize("causal,nk", [(True, 21), (False, 21), (False, 1)])
def test_gross_magnitudes_bound_the_results(causal, nk):
    bsz, hq, hk, nq, dim = 2, 4, 2, 13, 16
    q, k, v = _rand(bsz, hq, nq, dim, seed=111), _rand(bsz, hk, nk, dim, seed=112), _rand(bsz, hk, nk, dim, seed=113)
    dout = _rand(bsz, hq, nq, dim, seed=114)
    params = {"alpha": torch.tensor([0.5, 1.0, 3.0, 20.0], dtype=F64), "beta": torch.tensor([0.3, 1.0, 1.5, 2.5], dtype=F64),
              "mu": torch.tensor([0.0, 2.0, -1.0, 0.5], dtype=F64)}
    res = reference_attention(q, k, v, params, ggd_lp, kink=ggd_kink, causal=causal, q_offset=3, dout=dout)
    pairs = [("out", res.out), ("dq", res.dq), ("dk", res.dk), ("dv", res.dv)]
    pairs += [("d" + n, res.dparams[n]) for n in params]
    for name, x in pairs:
        g = res.gross[name]
        assert g.shape == x.shape and torch.isfinite(g).all(), name
        assert (x.abs() <= g * (1 + 1e-12) + 1e-300).all(), name
    if nk == 1:  # a single key: dS == 0, so dq, dk and every dtheta vanish, but their terms do not
        for name, x in pairs[1:3] + pairs[4:]:
            assert x.abs().max() < 1e-12 and res.gross[name].max() > 1e-3, name


def test_tolerance_gross_floor_is_elementwise():
    ref = torch.tensor([0.0, 0.0], dtype=F64)
    pt = torch.zeros(2)
    gross = torch.tensor([1e3, 1.0], dtype=F64)  # element 0 may carry ~2e-4 of fp32 noise, element 1 not
    from tests.tolerance import ACCUM_EPS
    ok = torch.tensor([0.9 * ACCUM_EPS * 1e3, 0.0])
    assert verdict("x", ok, ref, pt, torch.float32, gross).ok
    bad = torch.tensor([0.0, 0.9 * ACCUM_EPS * 1e3])  # the same error where the terms are small
    assert 0.9 * ACCUM_EPS * 1e3 > ATOL[torch.float32] + ACCUM_EPS
    assert not verdict("x", bad, ref, pt, torch.float32, gross).ok
