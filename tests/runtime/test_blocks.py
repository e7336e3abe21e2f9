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


POSITION_CASES = [   # (prior, backend, causal, Nq, Nk, split, per-head positions)
    ("forget_gate", "torch", True, 21, 21, 9, True),
    ("forget_gate", "triton", True, 17, 17, 8, True),
    ("generalized_gaussian", "torch", False, 13, 19, 7, False),
    ("generalized_gaussian", "triton", True, 16, 16, 5, False),
]


@pytest.mark.parametrize("case", POSITION_CASES, ids=lambda c: "-".join(map(str, c)))
def test_blocks_with_positions_add_up_to_the_whole(case):
    """Positions as tensors through the block API (the ring's, docs/positions.md): the offsets
    place each block of keys for the causal mask, its slice of pos_k places it for the prior;
    the merged output and the blocks' shares of every gradient, the positions' included,
    equal one call with the same positions."""
    prior, backend, causal, Nq, Nk, split, per_head = case
    mod = load(prior)
    g = torch.Generator().manual_seed(Nq + Nk)
    B, H, D = 2, 2, 16
    q, dout = (torch.randn(B, H, Nq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, H, Nk, D, generator=g) for _ in range(2))
    shape = (B, H) if per_head else (B,)
    pos_q = torch.nn.functional.logsigmoid(torch.randn(*shape, Nq, generator=g) + 2).cumsum(-1)
    pos_k = torch.nn.functional.logsigmoid(torch.randn(*shape, Nk, generator=g) + 2).cumsum(-1)
    if Nq == Nk and causal:
        pos_k = pos_q
    params = mod.default_params(H)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, pos_q, pos_k)]
    p_one = {n: t.clone().requires_grad_() for n, t in params.items()}
    whole = mod.attention(*leaves[:3], **p_one, causal=causal, pos_q=leaves[3], pos_k=leaves[4],
                          backend=backend)
    want = torch.autograd.grad(whole, leaves + list(p_one.values()), dout)

    offset = Nk - Nq   # the queries are the last Nq positions of the keys' sequence
    kw = dict(causal=causal, backend=backend, q_offset=offset, **params)
    blocks = [(0, split), (split, Nk)]
    parts = [mod.forward_block(q, k[:, :, a:b], v[:, :, a:b], k_offset=a, pos_q=pos_q,
                               pos_k=pos_k[..., a:b], **kw) for a, b in blocks]
    out, stats = merge(parts)
    torch.testing.assert_close(out, whole.detach(), rtol=1e-5, atol=1e-5)
    dq = torch.zeros_like(q)
    dk, dv, dpos_k = [], [], []
    dpos_q = torch.zeros(B, H, Nq, 1)
    dparams = {n: 0 for n in mod.LEARNABLE}
    row_sums = 0
    for a, b in blocks:
        dq_b, dk_b, dv_b, dp_b, rows_b, dpq_b, dpk_b = mod.backward_block(
            dout, q, k[:, :, a:b], v[:, :, a:b], out, stats, k_offset=a, pos_q=pos_q,
            pos_k=pos_k[..., a:b], **kw)
        dq += dq_b
        dk.append(dk_b)
        dv.append(dv_b)
        dpos_q += dpq_b
        dpos_k.append(dpk_b)
        row_sums = row_sums + rows_b
        for n in mod.LEARNABLE:
            dparams[n] = dparams[n] + dp_b[n]
    got = [dq, torch.cat(dk, 2), torch.cat(dv, 2)]
    # [B, Hq, N, 1] shares, summed over the heads where the positions are shared ([B, N])
    fold = (lambda t: t[..., 0]) if per_head else (lambda t: t[..., 0].sum(1))
    if pos_k is pos_q:
        got += [fold(dpos_q) + fold(torch.cat(dpos_k, 2))] * 2
        want = list(want[:3]) + [want[3] + want[4]] * 2 + list(want[5:])
    else:
        got += [fold(dpos_q), fold(torch.cat(dpos_k, 2))]
    if mod.LEARNABLE:
        grads = mod.finish_param_grads(dparams, row_sums)
        got += [grads[n] for n in mod.LEARNABLE]
    names = ["dq", "dk", "dv", "dpos_q", "dpos_k"] + list(mod.LEARNABLE)
    for n, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("prior", ["laplace", "bam_ssmax"])
def test_blocks_take_autocast_s_dtype_as_attention_does(prior, backend):
    """Under torch.autocast forward_block and backward_block take q, k, v in its dtype, as
    attention() does: float32 q and k beside bfloat16 v ran into 'q, k and v must share a
    dtype', and BAM-SSMax's logit (not s + f(d): the torch path's general kernel) failed in its
    float32 matmuls, which autocast recast. The results equal the blocks' of the inputs cast
    by hand."""
    mod = load(prior)
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(4))
    params = mod.default_params(2)
    bf = [t.bfloat16() for t in (q, k, v)]
    out, stats = mod.forward_block(*bf, **params, backend=backend)
    want = mod.backward_block(dout, *bf, out, stats, **params, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_out, got_stats = mod.forward_block(q, k, v.bfloat16(), **params, backend=backend)
        got = mod.backward_block(dout, q, k, v, out, stats, **params, backend=backend)
    torch.testing.assert_close(got_out, out, rtol=0, atol=0)
    torch.testing.assert_close(got_stats, stats, rtol=0, atol=0)
    for w, x in zip(want[:3], got[:3]):
        assert x.dtype == torch.bfloat16
        torch.testing.assert_close(x, w, rtol=0, atol=0)
