"""The generated module's contract (docs/architecture.md, "The generated module"): argument checks, parameters, edge rows."""
import sys

import pytest
import torch

from generated import generalized_gaussian as ggd
from generated import laplace, uniform


def qkv(B=1, Hq=4, Hk=2, Nq=9, Nk=11, D=16, dtype=torch.float32):
    return (torch.randn(B, Hq, Nq, D, dtype=dtype), torch.randn(B, Hk, Nk, D, dtype=dtype),
            torch.randn(B, Hk, Nk, D, dtype=dtype))


P = dict(alpha=2.0, beta=1.0, mu=0.0)


@pytest.mark.parametrize("change, argument", [
    (lambda q, k, v: (q[0], k, v), "q"),
    (lambda q, k, v: (q, k.half(), v), "dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), "dtype"),
    (lambda q, k, v: (q, k[:, :, :5], v), "k and v"),
    (lambda q, k, v: (q, torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)), "batch"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), "head dim"),
    (lambda q, k, v: (q, torch.randn(1, 3, 11, 16), torch.randn(1, 3, 11, 16)), "multiple"),
])
def test_bad_tensors_raise_value_error_naming_the_argument(change, argument):
    q, k, v = change(*qkv())
    with pytest.raises(ValueError, match=argument):
        ggd.attention(q, k, v, **P)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(alpha=torch.ones(3)), "alpha"),
    (dict(beta=torch.ones(2, 2)), "beta"),
    (dict(mu="zero"), "mu"),
    (dict(q_offset=1.5), "q_offset"),
    (dict(k_offset=True), "k_offset"),
    (dict(causal="yes"), "causal"),
    (dict(scale=-1.0), "scale"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, argument):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=argument):
        ggd.attention(q, k, v, **{**P, **kwargs})


def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton'"):
        ggd.attention(*qkv(), **P, backend="triton")


def test_default_params_follow_the_spec_inits():
    values = ggd.default_params(8)
    assert torch.allclose(values["alpha"], torch.tensor([2.0 ** (h + 1) for h in range(8)]))
    assert torch.equal(values["beta"], torch.ones(8)) and torch.equal(values["mu"], torch.zeros(8))
    b = laplace.default_params(4)["b"]   # 1 / ALiBi slopes 2^(-8(h+1)/H)
    assert torch.allclose(1 / b, torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)]))


def test_the_base_module_class_says_to_use_a_prior_s_own():
    """A user who reaches for the base class every generated module exposes gets told what to
    construct instead, not an AttributeError from inside it."""
    with pytest.raises(TypeError, match=r"base class .*\.GeneralizedGaussianAttention\(num_heads=8\)"):
        ggd.PriorAttention(num_heads=8)
    assert ggd.GeneralizedGaussianAttention(num_heads=2).num_heads == 2


def test_module_parameters_stay_in_domain_and_train():
    attn = ggd.GeneralizedGaussianAttention(num_heads=4)
    names = sorted(n for n, _ in attn.named_parameters())
    assert names == ["raw_alpha", "raw_beta", "raw_mu"]
    values = attn.prior_params()
    for name, expected in ggd.default_params(4).items():
        assert torch.allclose(values[name], expected)
    q, k, v = qkv()
    with torch.no_grad():
        attn.raw_beta.fill_(-30.0)         # beta = exp(-30) > 0: still in its domain
    attn(q, k, v).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters())
    with pytest.raises(ValueError, match="num_heads"):
        attn(*qkv(Hq=2, Hk=2))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_that_see_no_key_are_zero_with_zero_gradients(backend):
    q, k, v = (t.requires_grad_() for t in qkv(Nq=6, Nk=8))
    out = ggd.attention(q, k, v, **P, causal=True, q_offset=0, k_offset=3, backend=backend)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    out.sum().backward()
    assert torch.equal(q.grad[:, :, :3], torch.zeros_like(q.grad[:, :, :3]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_uniform_matches_sdpa():
    q, k, v = qkv(Hq=2, Hk=2, Nq=40, Nk=40)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(uniform.attention(q, k, v, causal=True), expected, atol=1e-5)


def test_module_imports_no_triton_on_cpu():
    import subprocess
    code = ("import sys, torch; from generated import laplace; "
            "q = torch.randn(1, 2, 5, 16); laplace.attention(q, q, q, b=2.0); "
            "print('triton' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(__import__("tests.helpers").helpers.ROOT))
    assert res.stdout.strip() == "False", res.stderr
