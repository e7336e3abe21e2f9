"""forward_block / backward_block: attention over blocks of keys that merge exactly (the
building block of bamgen.distributed's ring attention and of split-KV decoding).

Split the keys of a call into two blocks at ragged places, merge the blocks' outputs and
statistics, and compare with one call over all keys; then give each block the merged rows and
check that the blocks' dq shares, their dk/dv and their parameter-gradient shares add up to the
gradients of the whole call (autograd through `attention`)."""
import math

import pytest
import torch

from tests.runtime.test_properties import PRIORS, load

CASES = [  # (prior, backend, causal, Nq, Nk, split, q_offset, Hq, Hk)
    ("generalized_gaussian", "torch", True, 33, 33, 17, 0, 4, 2),
    ("generalized_gaussian", "triton", False, 17, 40, 1, 0, 2, 1),
    ("laplace", "torch", False, 20, 31, 30, 0, 2, 2),
    ("laplace", "triton", True, 16, 48, 20, 32, 2, 1),
    ("uniform", "torch", True, 9, 9, 4, 0, 1, 1),
    # n (SSMax) counts the keys of the whole row: the blocks are given it
    ("bam_ssmax", "torch", True, 30, 30, 13, 0, 2, 1),
    ("bam_ssmax", "triton", False, 12, 21, 8, 0, 2, 2),
    ("bam_ssmax", "triton", True, 16, 48, 20, 32, 2, 1),
]


def merge(parts):
    """Merge (out, stats) of blocks of keys: the log-sum-exp rule in base 2, exact max."""
    m = torch.stack([s[..., 0] for _, s in parts]).amax(0)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(parts[0][0])
    for out, s in parts:
        w = torch.where(s[..., 1] > 0, s[..., 1] * torch.exp2(s[..., 0] - m_safe), torch.zeros_like(m))
        l = l + w
        acc = acc + out * w[..., None]
    out = acc / torch.where(l == 0, torch.ones_like(l), l)[..., None]
    return out, torch.stack([m, l], -1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_blocks_merge_to_the_whole(case):
    prior, backend, causal, Nq, Nk, split, q_offset, Hq, Hk = case
    mod = load(prior)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, Hq, Nq, 16, generator=g)
    k = torch.randn(2, Hk, Nk, 16, generator=g)
    v = torch.randn(2, Hk, Nk, 16, generator=g)
    dout = torch.randn(2, Hq, Nq, 16, generator=g)
    params = {n: t.clone().requires_grad_(n in mod.LEARNABLE) for n, t in mod.default_params(Hq).items()}
    kw = dict(causal=causal, q_offset=q_offset, backend=backend)

    qw, kw_, vw = (t.clone().requires_grad_(True) for t in (q, k, v))
    whole = mod.attention(qw, kw_, vw, **params, **kw)
    whole.backward(dout)

    blocks = [(0, split), (split, Nk)]
    rows = torch.arange(Nq) + q_offset            # n: the keys of the whole row each query sees
    kw["n"] = (rows + 1).clamp(0, Nk) if causal else torch.full((Nq,), Nk)
    parts = [mod.forward_block(q, k[:, :, a:b], v[:, :, a:b], **params, k_offset=a, **kw)
             for a, b in blocks]
    out, stats = merge(parts)
    torch.testing.assert_close(out, whole.detach(), rtol=1e-5, atol=1e-5)

    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dparams = {n: torch.zeros(Hq) for n in mod.LEARNABLE}
    rows = 0
    for a, b in blocks:
        dq_b, dk_b, dv_b, dp_b, rows_b = mod.backward_block(dout, q, k[:, :, a:b], v[:, :, a:b], out,
                                                            stats, **params, k_offset=a, **kw)
        dq += dq_b
        dk[:, :, a:b] = dk_b
        dv[:, :, a:b] = dv_b
        rows = rows + rows_b
        for n in mod.LEARNABLE:
            dparams[n] += dp_b[n]
    dparams = mod.finish_param_grads(dparams, rows)
    torch.testing.assert_close(dq, qw.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk, kw_.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv, vw.grad, rtol=1e-4, atol=1e-5)
    for n in mod.LEARNABLE:
        torch.testing.assert_close(dparams[n], params[n].grad, rtol=1e-4, atol=1e-4)


def test_block_statistics_are_exact_for_the_row_max():
    """m is the row's largest z itself (not a rounded log-sum-exp), l >= 1 for a row that sees
    a key and exactly (-inf, 0) for a row that sees none."""
    mod = load("laplace")
    q = torch.randn(1, 1, 5, 8)
    k = torch.randn(1, 1, 3, 8)
    out, stats = mod.forward_block(q, k, k, b=2.0, causal=True, k_offset=2, backend="torch")
    assert torch.isinf(stats[0, 0, :2, 0]).all() and (stats[0, 0, :2, 1] == 0).all()
    assert (out[0, 0, :2] == 0).all()
    assert (stats[0, 0, 2:, 1] >= 1).all()
    z = (q[0, 0, 2] @ k[0, 0, 0]) / math.sqrt(8) * math.log2(math.e)   # row 2 sees key 0 only
    torch.testing.assert_close(stats[0, 0, 2, 0], z, rtol=1e-6, atol=1e-6)
