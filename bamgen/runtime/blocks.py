"""Blocks: attention over one block of keys without autograd, for libraries that combine blocks
(ring attention in bamgen.distributed, split-KV decoding). The row statistics of two blocks of
keys merge exactly: m = max(m1, m2), l = l1 * 2**(m1 - m) + l2 * 2**(m2 - m), and
out = (out1 * l1 * 2**(m1 - m) + out2 * l2 * 2**(m2 - m)) / l. The backward of a block, given
the merged out and statistics of the whole row, gives that block's share of dq and its keys'
dk, dv and parameter gradients; the shares add up to the gradients of the whole.
"""
from __future__ import annotations

import math

import torch

from . import checks
from .autograd import autocast_off, use_triton
from .cpu import backward as cpu_backward
from .cpu import forward as cpu_forward
from .params import grads_by_name, param_block, theta as make_theta
from .positions import given_positions
from .tables import distance_prior


def forward_block(prior, q, k, v, values, causal=True, scale=None, q_offset=0, k_offset=0,
                  backend="auto", n=None, pos_q=None, pos_k=None):
    """(out, stats): out float32 [B, Hq, Nq, D] (0 where a row sees no key of this block) and
    stats float32 [B, Hq, Nq, 2], per row m (the base-2 max of z = logit * log2(e), -inf for a
    row that sees no key) and l = sum_j exp2(z_j - m) (0 for such a row). No autograd.
    n: for a prior that reads n, the number of keys each row sees over all blocks, a tensor
    [B, Nq] or [Nq] (default: the keys of this block it sees).
    pos_q, pos_k: the rows' and keys' positions as tensors (docs/positions.md), read by the
    prior; the offsets still place the block for the causal mask.
    Under torch.autocast q, k, v are taken in its dtype, as attention() takes them."""
    q, k, v = checks.autocast_inputs(q, k, v)
    checks.check_inputs(q, k, v, causal, scale, backend)
    checks.check_causal(prior.traits, causal, pos_q, pos_k)
    q_offset, k_offset = checks.block_offsets(q, k, q_offset, k_offset)
    pos = given_positions(prior, q, k, pos_q, pos_k)
    theta = make_theta(prior.traits, q, values, grad=False, check=prior.domain_check,
                       head_rows=True)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    with torch.no_grad(), autocast_off():   # (q, k, v are in autocast's dtype)
        pos_t = None if pos is None else (pos.q, pos.k)
        if use_triton(q, backend):
            from .triton import launch
            out, stats, out32, _table = launch.forward(prior, q, k, v, theta, causal, scale,
                                                       q_offset, k_offset, for_backward=True,
                                                       shifted=False, n=n, pos=pos_t)
            return out32.float(), stats.permute(1, 2, 3, 0).contiguous()
        if pos is not None:
            return cpu_forward.forward_generic(prior, q.contiguous(), k.contiguous(), v.contiguous(),
                                               theta, causal, scale, q_offset, k_offset,
                                               shifted=False, n=n, pos=pos_t)
        out, stats = cpu_forward.forward_f32(prior, q, k, v, theta, causal, scale, q_offset, k_offset,
                                             shifted=False, n=n)
        return out, stats


def backward_block(prior, dout, q, k, v, out, stats, values, causal=True, scale=None, q_offset=0,
                   k_offset=0, backend="auto", n=None, pos_q=None, pos_k=None):
    """(dq, dk, dv, dparams, row_sums) of one block of keys, given dout and the merged out
    (float32) and stats [B, Hq, Nq, 2] of the rows over all blocks: dq is this block's share;
    dparams {learnable name: float32 [Hq]} and row_sums (float32 [B, Hq, Nq, 1 + learnable])
    add up over the blocks, and finish_param_grads(sum of dparams, sum of row_sums) gives the
    parameters' gradients. n: as forward_block's. No autograd.
    pos_q, pos_k: as forward_block's; then (dpos_q, dpos_k) follow, [B, Hq, N, C] in the
    compute dtype: this block's shares of the rows' sums of dS * d logit / d i_c and the keys'
    sums of dS * d logit / d j_c (no row correction: they add up over the blocks as they are).
    Under torch.autocast q, k, v are taken in its dtype, as forward_block takes them."""
    q, k, v = checks.autocast_inputs(q, k, v)
    checks.check_inputs(q, k, v, causal, scale, backend)
    checks.check_causal(prior.traits, causal, pos_q, pos_k)
    q_offset, k_offset = checks.block_offsets(q, k, q_offset, k_offset)
    pos = given_positions(prior, q, k, pos_q, pos_k)
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape:
            raise ValueError(f"{name} must be a tensor of q's shape {tuple(q.shape)}")
    if not isinstance(stats, torch.Tensor) or stats.shape != (*q.shape[:3], 2):
        raise ValueError(f"stats must be a float32 tensor of shape {(*q.shape[:3], 2)}")
    theta = make_theta(prior.traits, q, values, grad=False, check=prior.domain_check,
                       head_rows=True)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    out, stats = out.to(theta.dtype), stats.to(theta.dtype)
    pos_t = None if pos is None else (pos.q, pos.k)
    dpos = ()
    with torch.no_grad(), autocast_off():   # (q, k, v are in autocast's dtype)
        if use_triton(q, backend):
            from .triton import launch
            dq, dk, dv, dparams, rows, *dpos = launch.backward(
                prior, dout, q, k, v, out, stats.permute(3, 0, 1, 2).contiguous(), out, None, theta,
                causal, scale, q_offset, k_offset, row_sums=True, shifted=False, n=n, pos=pos_t)
        else:   # (the table path sums dS per distance and leaves the rows 0)
            rows = torch.zeros(*q.shape[:3], 1 + prior.traits.num_grads, device=q.device,
                               dtype=theta.dtype)
            if pos is not None:
                dq, dk, dv, dparams, *dpos = cpu_backward.backward_generic(
                    prior, dout, q.contiguous(), k.contiguous(), v.contiguous(), out, stats, theta,
                    causal, scale, q_offset, k_offset, shifted=False, rows=rows, n=n, pos=pos_t)
            else:
                dq, dk, dv, dparams = cpu_backward.backward(prior, dout, q, k, v, out, stats, theta,
                                                            causal, scale, q_offset, k_offset,
                                                            shifted=False, rows=rows, n=n)
    return (dq, dk, dv, grads_by_name(prior.traits, dparams), rows, *dpos)


def log_prior_at(prior, d, values, num_heads=None):
    """The log-prior at distances d = i - j (integers, a 1-D tensor or list), float64
    [num_heads, len(d)], for a prior that depends on the positions through d alone (for a score
    s + b, b: what the score adds to s, which is what hides a key): what a library needs to
    know where a prior's window (-inf) lies, to skip blocks it hides.
    num_heads defaults to the parameters' length. ValueError for a prior that reads i, j or n."""
    if not (prior.traits.distance_table or not prior.traits.params):
        raise ValueError(f"the {prior.traits.name!r} prior reads positions other than d = i - j")
    d = torch.as_tensor(d)
    if d.dim() != 1 or d.is_floating_point() and not bool((d == d.round()).all()):
        raise ValueError("d must be a 1-D tensor of integer distances")
    if prior.traits.causal_only and bool((d < 0).any()):
        raise ValueError(f"d holds {int(d.min())}: the prior {prior.traits.name!r} declares "
                         f"causal_only: true, its log-prior defined only at d >= 0 (a key at or "
                         f"before its query)")
    heads = num_heads or max([1] + [_heads_of(prior.traits.param(name), x)
                                    for name, x in values.items()])
    theta = torch.cat([param_block(p, values[p.name], heads, d.device, torch.float64, True)
                       for p in prior.traits.params], dim=1) if prior.traits.params else None
    prm = [theta[:, c:c + 1] for c in range(theta.shape[1])] if theta is not None else []
    value = distance_prior(prior, d.to(torch.float64)[None], prm)[0]
    return torch.as_tensor(value, dtype=torch.float64).expand(heads, d.shape[0]).clone()


def _heads_of(param, value) -> int:
    """How many heads a parameter value gives (1 for a float or a value shared by the heads)."""
    value = torch.as_tensor(value)
    if param.size is None:
        return value.numel()
    return value.shape[0] if value.dim() == 2 else 1


def finish_param_grads(prior, dparams, row_sums):
    """The parameters' gradients from backward_block's dparams and row_sums, each summed over
    all blocks of keys: sum_j dS_ij g_ij minus, per row, (sum_j dS_ij)(sum_j P_ij g_ij), which is
    0 in exact arithmetic and removes the error of dS computed from a rounded P (see the dQ
    kernel). Returns {learnable name: float32 [Hq]}."""
    correction = row_sums[..., :1] * row_sums[..., 1:]          # [B, Hq, Nq, learnable scalars]
    correction = grads_by_name(prior.traits, correction.sum(dim=(0, 2)))   # [Hq, ...] per name
    return {name: dparams[name] - correction[name] for name in prior.traits.learnable}
