"""The CPU path's backward (backend="torch" on any device): closed-form gradients of q, k, v
and every learnable parameter (docs/architecture.md, "CPU path")."""
from __future__ import annotations

import math

import torch

from ..constants import LOG2E
from ..tables import acc_dtype, row_key_counts
from .forward import forward_call
from . import common
from .common import (
    call_parts, doc_groups, gather_items, hide_padding, inputs_finite, key_limit, masks_nothing,
    param_columns, positions, quiet_dead_rows, row_terms, table_tile, tensor_positions, work_items)
from .hooks import (distance_tables, entries_at, generic_tables, logit_grads, position_tables,
                    table_logit, table_logit_grads)


def backward(prior, dout, q, k, v, out, stats, theta, causal, scale, q_offset, k_offset, shifted=True,
             rows=None, n=None, key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, pos=None,
             position_grads=True):
    """dq, dk, dv (input dtype) and the learnable parameters' gradients [Hq, prior.traits.num_grads]:
    the parts of the call (call_parts) as the forward split it.
    rows: see _backward_generic (the table path needs no row correction: it sums dS
    per distance in float64 against derivatives shifted to be small where it matters).
    pos: the forward's position tensors (see forward.forward): then the generic path, and the
    positions' gradients after the others, (dpos_q, dpos_k) like pos; zeros, not summed, where
    position_grads is False (no position requires grad: backward_generic)."""
    if pos is not None:
        return positional_backward(prior, dout, q, k, v, out, stats, theta, causal, scale, shifted,
                                   n, key_mask, cu_seqlens_q, cu_seqlens_k, pos, q_offset, k_offset,
                                   position_grads)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    parts = call_parts(B, Nq, Nk, q_offset, k_offset, cu_seqlens_q, cu_seqlens_k)
    if len(parts) == 1 and parts[0][1:6:2] == (B, Nq, Nk):
        return backward_call(prior, dout, q, k, v, out, stats, theta, causal, scale, parts[0][6],
                             parts[0][7], shifted, rows, n, key_mask)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dparams = torch.zeros(Hq, prior.traits.num_grads, dtype=theta.dtype, device=q.device)
    if cu_seqlens_q is not None:   # packed: the forward's batches of documents
        for group in doc_groups(parts, causal, key_mask, q.device):
            # (padding rows: dO and O are 0 and their statistics those of a row that sees no
            # key, so they contribute nothing)
            stats_g = group.gather(stats, 0, fill=torch.tensor([-math.inf, 0.0], dtype=stats.dtype))
            dq_g, dk_g, dv_g, dp_g = backward_call(
                prior, group.gather(dout, 0), group.gather(q, 0), group.gather(k, 1), group.gather(v, 1),
                group.gather(out, 0), stats_g, theta, causal, scale, 0, 0, shifted, None, None,
                group.key_mask)
            group.scatter(dq, dq_g, 0)
            group.scatter(dk, dk_g, 1)
            group.scatter(dv, dv_g, 1)
            dparams += dp_g
        return dq, dk, dv, dparams
    for b0, b1, i0, i1, j0, j1, qo, ko in parts:
        if i1 > i0 and j1 > j0:
            km = None if key_mask is None else key_mask[b0:b1, j0:j1]
            rows_p = None if rows is None else rows[b0:b1, :, i0:i1]
            dq_p, dk_p, dv_p, dp_p = backward_call(
                prior, dout[b0:b1, :, i0:i1], q[b0:b1, :, i0:i1], k[b0:b1, :, j0:j1], v[b0:b1, :, j0:j1],
                out[b0:b1, :, i0:i1], stats[b0:b1, :, i0:i1], theta, causal, scale, qo, ko, shifted,
                rows_p, None, km)
            dq[b0:b1, :, i0:i1] = dq_p
            dk[b0:b1, :, j0:j1] += dk_p
            dv[b0:b1, :, j0:j1] += dv_p
            dparams += dp_p
    return dq, dk, dv, dparams


def positional_backward(prior, dout, q, k, v, out, stats, theta, causal, scale, shifted, n,
                        key_mask, cu_seqlens_q, cu_seqlens_k, pos, q_offset=0, k_offset=0,
                        position_grads=True):
    """backward() of a call with position tensors: (dq, dk, dv, dparams, dpos_q, dpos_k), packed
    documents as the forward grouped them (and offsets 0)."""
    if cu_seqlens_q is None:
        return _positional_call(prior, dout, q, k, v, out, stats, theta, causal, scale, shifted, n,
                                key_mask, pos, q_offset, k_offset, position_grads)
    B, Hq, Nq, D = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dpos = [torch.zeros(p.shape, dtype=acc_dtype(q), device=q.device) for p in pos]
    dparams = torch.zeros(Hq, prior.traits.num_grads, dtype=theta.dtype, device=q.device)
    parts = call_parts(B, Nq, k.shape[2], 0, 0, cu_seqlens_q, cu_seqlens_k)
    for group in doc_groups(parts, causal, key_mask, q.device):
        stats_g = group.gather(stats, 0, fill=torch.tensor([-math.inf, 0.0], dtype=stats.dtype))
        dq_g, dk_g, dv_g, dp_g, dpq_g, dpk_g = _positional_call(
            prior, group.gather(dout, 0), group.gather(q, 0), group.gather(k, 1),
            group.gather(v, 1), group.gather(out, 0), stats_g, theta, causal, scale, shifted, None,
            group.key_mask, (group.gather(pos[0], 0), group.gather(pos[1], 1)),
            position_grads=position_grads)
        for t, g, side in ((dq, dq_g, 0), (dk, dk_g, 1), (dv, dv_g, 1), (dpos[0], dpq_g, 0),
                           (dpos[1], dpk_g, 1)):
            group.scatter(t, g, side)
        dparams += dp_g
    return dq, dk, dv, dparams, dpos[0], dpos[1]


def _positional_call(prior, dout, q, k, v, out, stats, theta, causal, scale, shifted, n, key_mask,
                     pos, q_offset=0, k_offset=0, position_grads=True):
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    k, v = hide_padding(k, v, key_mask)
    q, dout, out, v = quiet_dead_rows(q, dout, out, v, stats.contiguous())
    return hidden_keys_get_nothing(backward_generic(
        prior, dout, q, k, v, out, stats.contiguous(), theta, causal, scale, q_offset, k_offset,
        shifted, None, n, key_mask, pos, position_grads), key_mask)


def backward_call(prior, dout, q, k, v, out, stats, theta, causal, scale, q_offset, k_offset, shifted,
                  rows, n, key_mask):
    """The backward of one _forward_call."""
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    k, v = hide_padding(k, v, key_mask)
    stats = stats.contiguous()
    if out.dtype != acc_dtype(q):
        # delta = rowsum(dO * O) must see O before its rounding to the input dtype (that error is
        # of the storage precision, not of float32): recompute it (one more forward pass).
        out = forward_call(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted, n,
                           key_mask)[0]
    q, dout, out, v = quiet_dead_rows(q, dout, out, v, stats)
    if prior.traits.table_path:
        careful = key_mask is not None or not (
            masks_nothing(k.shape[2], causal, q_offset, k_offset) or inputs_finite(q, k))
        # (a block of keys, rows given: its dS does not sum to 0 over a row, so no row anchor)
        return hidden_keys_get_nothing(table_backward(
            prior, dout, q, k, v, out, stats, theta, causal, scale, q_offset, k_offset, shifted,
            careful=careful, key_mask=key_mask, row_anchor=rows is None), key_mask)
    return hidden_keys_get_nothing(backward_generic(
        prior, dout, q, k, v, out, stats, theta, causal, scale, q_offset, k_offset, shifted, rows,
        n, key_mask), key_mask)


def hidden_keys_get_nothing(grads: tuple, key_mask) -> tuple:
    """(dq, dk, dv, dparams[, dpos_q, dpos_k]) with dk, dv (and dpos_k) 0 at the keys key_mask
    hides, as no query sees them: a row that a NaN in its q reached made them 0 * NaN (dS^T q,
    dS 0 there), where the kernels, which skip those keys, give 0."""
    if key_mask is None:
        return grads
    hidden = ~key_mask[:, None, :, None]
    dq, dk, dv, dparams, *dpos = grads
    dk, dv = dk.masked_fill(hidden, 0.0), dv.masked_fill(hidden, 0.0)
    if dpos:
        dpos[1] = dpos[1].masked_fill(hidden, 0.0)
    return (dq, dk, dv, dparams, *dpos)


def backward_generic(prior, dout, q, k, v, out, stats, theta, causal, scale, q_offset, k_offset,
                     shifted=True, rows=None, n=None, key_mask=None, pos=None, position_grads=True):
    """Closed-form backward: P rebuilt from the forward's statistics, dS = P * (dP - rowsum(dO * O)).
    z is computed exactly as the forward computed it (same tiles, same logit hook).
    rows (backward_block): a [B, Hq, Nq, 1 + P] tensor that receives the row sums of the
    correction below instead of applying it (see finish_param_grads).
    pos: position tensors (backward()): the result has their gradients after the others, the
    row sums of dS * d logit / d i_c for pos_q and the column sums of dS * d logit / d j_c for
    pos_k, in float64 tiles (a FoX row's dS sums to 0 against a derivative of 1); zeros,
    summed over no tile, where no position moves the logit (traits.position_grads: NoPE, T5's
    buckets, whose derivatives the compiler found 0) or the call wants none (position_grads:
    no position requires grad, integer positions among them)."""
    B, Hq, Nq, D = q.shape
    cdt = acc_dtype(q)   # the compute dtype
    tables = position_tables(prior, theta, pos, True, shifted) if pos is not None else \
        generic_tables(prior, theta, Nq, k.shape[2], q_offset, k_offset, causal, True, shifted)
    counts = row_key_counts(prior, q.shape[0], Nq, k.shape[2], q_offset, k_offset, causal, q.device, n, key_mask)
    Hk, Nk = k.shape[1], k.shape[2]
    G = Hq // Hk
    dev = q.device
    qg = q.to(cdt).reshape(B, Hk, G, Nq, D)
    dog = dout.to(cdt).reshape(B, Hk, G, Nq, D)
    kf, vf = k.to(cdt), v.to(cdt)
    m_row, inv_l, delta = row_terms(dout, out, stats, B, Hk, G, Nq)
    dq = torch.zeros(B, Hk, G, Nq, D, dtype=cdt, device=dev)
    BM, BN = max(32, common.TORCH_BLOCK_M // G), common.TORCH_BLOCK_N  # a tile holds G * BM query rows
    P = prior.traits.num_grads
    score_is_s = prior.traits.score_is_s

    dk = torch.zeros(B, Hk, Nk, D, dtype=cdt, device=dev)
    dv = torch.zeros_like(dk)
    # parameter gradients in float64: their terms (dS times a derivative such as SSMax's
    # (s + log_prior) log n) cancel over each row, and a float32 dot of a tile's terms lost
    # several ulps of their magnitude
    dparams = torch.zeros(B, Hk * G, P, dtype=torch.float64, device=dev)
    C = 0 if pos is None else pos[0].shape[-1]
    position_sums = pos is not None and position_grads and prior.traits.position_grads
    dpos_q = torch.zeros(B, Hk, G, Nq, C, dtype=torch.float64, device=dev)
    dpos_k = torch.zeros(B, Hk, G, Nk, C, dtype=torch.float64, device=dev)

    def run(item, private):
        b, h0, h1, blocks = item
        n = h1 - h0
        prm = param_columns(theta, h0, h1, G)
        if private:
            dk_t, dv_t = (torch.zeros(n, Nk, D, dtype=cdt, device=dev) for _ in range(2))
            dp_t = torch.zeros(n * G, P, dtype=torch.float64, device=dev)
            dpk_t = torch.zeros(n, G, Nk, C, dtype=torch.float64, device=dev)
        else:
            dk_t, dv_t, dp_t = dk[b, h0:h1], dv[b, h0:h1], dparams[b, h0 * G:h1 * G]
            dpk_t = dpos_k[b, h0:h1]
        for i0 in blocks:
            i1 = min(Nq, i0 + BM)
            bm = i1 - i0
            qb = qg[b, h0:h1, :, i0:i1].mul(scale).reshape(n, G * bm, D)
            dob = dog[b, h0:h1, :, i0:i1].mul(inv_l[b, h0:h1, :, i0:i1, None]).reshape(n, G * bm, D)
            m_b = m_row[b, h0:h1, :, i0:i1, None]
            delta_b = delta[b, h0:h1, :, i0:i1, None]
            dqb = torch.zeros(n, G * bm, D, dtype=cdt, device=dev)
            # per row: sum_j dS and sum_j P * d logit / d param, for the correction below
            row_ds = torch.zeros(n * G, bm, dtype=torch.float64, device=dev)
            row_pg = torch.zeros(n * G, bm, P, dtype=torch.float64, device=dev)
            inv_l_b = inv_l[b, h0:h1, :, i0:i1].reshape(n * G, bm).double()
            # rows that see no key (l = 0: a packed document's padding rows among them) have
            # m read as 0, so their exp2(z - m) is not P and may overflow (a padding row at FoX
            # position 0 against keys at c_j = -120): it is zeroed, or inf * 0 would be NaN
            dead = inv_l[b, h0:h1, :, i0:i1, None] == 0
            dead = dead if bool(dead.any()) else None
            for j0 in range(0, key_limit(i1, Nk, causal, q_offset, k_offset), BN):
                j1 = min(Nk, j0 + BN)
                bn = j1 - j0
                kb, vb = kf[b, h0:h1, j0:j1], vf[b, h0:h1, j0:j1]
                s = torch.bmm(qb, kb.transpose(1, 2)).view(n, G, bm, bn)
                pos_d, pos_i, pos_j, pos_n, visible = positions(
                    i0, i1, j0, j1, q_offset, k_offset, counts[b], causal, dev, cdt,
                    prior.traits.clamp_positions)
                if key_mask is not None:   # padding keys: never attended
                    km = key_mask[b, j0:j1][None, :]
                    visible = km if visible is None else visible & km
                if pos is not None:
                    pos_d, pos_i, pos_j = tensor_positions(pos, b, h0, h1, G, i0, i1, j0, j1)
                # z as the forward had it (its own hook: the CSE of the derivatives may round the
                # logit otherwise), into a fresh buffer (a derivative printed as `s` may alias s)
                if tables is None:
                    _logit, dlogit_ds, *dlogit_dparams = logit_grads(prior, s, pos_d, pos_i, pos_j, pos_n, prm)
                    logit = prior.torch.logit(s, pos_d, pos_i, pos_j, pos_n, prm)
                else:
                    tab_v, *tabs = entries_at(tables, h0, h1, G, Nq, i0, i1, j0, j1, pos_d)
                    _logit, dlogit_ds, *dlogit_dparams = table_logit_grads(prior, s, tab_v, tabs, pos_d, pos_i,
                                                                           pos_j, pos_n, prm)
                    logit = table_logit(prior, s, tab_v, pos_d, pos_i, pos_j, pos_n, prm)
                z = torch.mul(logit, LOG2E, out=torch.empty_like(s))
                p = z.sub_(m_b).exp2_()  # P * l
                if visible is not None:
                    p.masked_fill_(~visible, 0.0)
                if dead is not None:
                    p.masked_fill_(dead, 0.0)
                p3 = p.view(n, G * bm, bn)
                dv_t[:, j0:j1].baddbmm_(p3.transpose(1, 2), dob)
                ds = torch.bmm(dob, vb.transpose(1, 2)).view(n, G, bm, bn).sub_(delta_b).mul_(p)
                if visible is not None:   # dS = 0 where masked, even in a row whose delta is NaN
                    ds.masked_fill_(~visible, 0.0)
                # where(): a derivative may be inf/nan on a masked score, where ds is 0
                seen = p > 0 if dlogit_dparams or not score_is_s or position_sums else None
                if position_sums:   # (dS here is d loss / d logit)
                    _position_sums(prior, ds, seen, s, pos_d, pos_i, pos_j, pos_n, prm, C,
                                   dpos_q[b, h0:h1, :, i0:i1], dpk_t[:, :, j0:j1])
                if dlogit_dparams:
                    row_ds += ds.view(n * G, bm, bn).sum(-1, dtype=torch.float64)
                for g, dlogit_dparam in enumerate(dlogit_dparams):
                    dl = torch.where(seen, dlogit_dparam, 0.0).reshape(n * G, bm * bn, 1)
                    dp_t[:, g] += torch.bmm(ds.view(n * G, 1, bm * bn).double(), dl.double()).view(n * G)
                    row_pg[..., g] += (p.view(n * G, bm, bn) * dl.view(n * G, bm, bn)).sum(-1, dtype=torch.float64)
                if not score_is_s:
                    ds = torch.where(seen, ds * dlogit_ds, 0.0)
                ds3 = ds.view(n, G * bm, bn)
                dqb.baddbmm_(ds3, kb)
                dk_t[:, j0:j1].baddbmm_(ds3.transpose(1, 2), qb)
            dq[b, h0:h1, :, i0:i1] = dqb.view(n, G, bm, D).mul_(scale)
            # Subtract, per row, (sum_j dS)(sum_j P g): 0 in exact arithmetic (dS sums to 0 over a
            # row), it removes to first order the error that the rounding of delta = rowsum(dO * O)
            # leaves in that sum, which a derivative of large magnitude (SSMax's (s + log_prior)
            # log n far from the prior's mode) would otherwise multiply
            row_pg *= inv_l_b[..., None]
            if rows is None:
                dp_t -= (row_ds[..., None] * row_pg).sum(1)
            else:
                rows[b, h0 * G:h1 * G, i0:i1, 0] = row_ds.to(rows.dtype)
                rows[b, h0 * G:h1 * G, i0:i1, 1:] = row_pg.to(rows.dtype)
        return dk_t, dv_t, dp_t, dpk_t

    def add(item, dk_t, dv_t, dp_t, dpk_t):
        b, h0, h1, _ = item
        dk[b, h0:h1] += dk_t
        dv[b, h0:h1] += dv_t
        dparams[b, h0 * G:h1 * G] += dp_t
        dpos_k[b, h0:h1] += dpk_t

    first = max(0, k_offset - q_offset) if causal else 0   # rows before it see no key: dq = 0
    items, shared = work_items(B, Hk, G, list(range(first, Nq, BM)))
    gather_items(items, shared, run, add, B * Hq * Nq * Nk)
    dparams = dparams.sum(0).to(cdt)
    grads = (dq.reshape(B, Hq, Nq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams)
    if pos is None:
        return grads
    return (*grads, dpos_q.reshape(B, Hq, Nq, C).to(cdt), dpos_k.reshape(B, Hq, Nk, C).to(cdt))


def _position_sums(prior, ds, seen, s, pos_d, pos_i, pos_j, pos_n, prm, C, into_q, into_k):
    """Add one tile's share of the position gradients: into_q [n, G, rows, C] += the row sums of
    dS * d logit / d i_c, into_k [n, G, keys, C] += the column sums of dS * d logit / d j_c
    (0 where P is: a derivative may be infinite on a masked score)."""
    grads = prior.torch.position_grads(s, pos_d, pos_i, pos_j, pos_n, prm)
    ds64 = ds.double()
    for c in range(C):
        for g, into, axis in ((grads[c], into_q, -1), (grads[C + c], into_k, -2)):
            g = torch.where(seen, torch.as_tensor(g, dtype=ds.dtype, device=ds.device), 0.0)
            into[..., c] += (ds64 * g).sum(axis)


def table_backward(prior, dout, q, k, v, out, stats, theta, causal, scale, q_offset, k_offset, shifted=True,
                   careful=False, key_mask=None, row_anchor=True):
    """Closed-form backward over [BM, BN] tiles with the bias gathered from the table.

    The parameter gradient is sum_d (sum of dS over the diagonal d) * d bias / d param (d): dS is
    written into a zero-padded buffer whose skewed view (row stride W - 1) turns the block's
    anti-diagonals into columns, so one reduction gives the per-distance sums. Work items are
    (batch, KV-head range, query blocks), each with its own two tile buffers (S/P and dP/dS).
    """
    B, Hq, Nq, D = q.shape
    cdt = acc_dtype(q)   # the compute dtype
    Hk, Nk = k.shape[1], k.shape[2]
    G = Hq // Hk
    L = Nq + Nk - 1
    dev = q.device
    table, dtables = distance_tables(prior, theta, Nq, Nk, q_offset, k_offset, causal, True, shifted)
    qg = q.to(cdt).reshape(B, Hk, G, Nq, D)
    dog = dout.to(cdt).reshape(B, Hk, G, Nq, D)
    kf, vf = k.to(cdt), v.to(cdt)
    m_row, inv_l, delta = row_terms(dout, out, stats, B, Hk, G, Nq)
    # a row whose delta is inf or NaN (an inf in v or dO) makes a masked score's dS 0 * inf:
    # such scores are then zeroed, as with non-finite q or k (the caller's check)
    careful = careful or not (masks_nothing(Nk, causal, q_offset, k_offset)
                              or bool(torch.isfinite(delta).all()))
    dq = torch.zeros(B, Hk, G, Nq, D, dtype=cdt, device=dev)
    BM, BN = table_tile(Nq, Nk, G)
    W = BM + BN
    first = max(0, k_offset - q_offset) if causal else 0
    items, shared = work_items(B, Hk, G, list(range(first, Nq, BM)))
    table2 = table.mul_(LOG2E).view(Hk, G, L)      # base 2: P = exp2(s2 + bias2 - m) / l
    scale2 = scale * LOG2E

    dk = torch.zeros(B, Hk, Nk, D, dtype=cdt, device=dev)
    dv = torch.zeros_like(dk)
    dsum = torch.zeros(B, Hk, G, L, dtype=torch.float64, device=dev)
    row_ds = torch.zeros(B, Hk, G, Nq, dtype=torch.float64, device=dev)   # sum_j dS per row

    def run(item, private):
        b, h0, h1, my_blocks = item
        n = h1 - h0
        if private:
            dk_t, dv_t = (torch.zeros(n, Nk, D, dtype=cdt, device=dev) for _ in range(2))
            dsum_t = torch.zeros(n, G, L, dtype=torch.float64, device=dev)
        else:
            dk_t, dv_t, dsum_t = dk[b, h0:h1], dv[b, h0:h1], dsum[b, h0:h1]
        rows = n * G * BM
        s_buf = torch.empty(rows * BN, dtype=cdt, device=dev)
        skew = torch.zeros(rows * W, dtype=cdt, device=dev)
        skew_rows = None
        kb_all, vb_all = kf[b, h0:h1], vf[b, h0:h1]
        tab = table2[h0:h1]
        for i0 in my_blocks:
            i1 = min(Nq, i0 + BM)
            bm = i1 - i0
            kend = key_limit(i1, Nk, causal, q_offset, k_offset)
            if bm != skew_rows:  # a new row count changes the buffer's layout: clear it
                skew.zero_()
                skew_rows = bm
            hstr = (G * bm * W, bm * W)
            qb = qg[b, h0:h1, :, i0:i1].flip(-2).mul_(scale2).reshape(n, G * bm, D)
            inv_b = inv_l[b, h0:h1, :, i0:i1].flip(-1)[..., None]
            dob = dog[b, h0:h1, :, i0:i1].flip(-2).mul_(inv_b).reshape(n, G * bm, D)
            m_b = m_row[b, h0:h1, :, i0:i1].flip(-1)[..., None]
            delta_b = delta[b, h0:h1, :, i0:i1].flip(-1)[..., None]
            dqb = torch.zeros(n, G * bm, D, dtype=cdt, device=dev)
            rows_t = torch.zeros(n, G, bm, dtype=torch.float64, device=dev)
            for j0 in range(0, kend, BN):
                j1 = min(kend, j0 + BN)
                bn = j1 - j0
                kb, vb = kb_all[:, j0:j1], vb_all[:, j0:j1]
                s = torch.bmm(qb, kb.transpose(1, 2), out=s_buf[:n * G * bm * bn].view(n, G * bm, bn))
                bias = tab.as_strided((n, G, bm, bn), (G * L, L, 1, 1),
                                      tab.storage_offset() + (Nq - i1) + j0)
                p = s.view(n, G, bm, bn).add_(bias).sub_(m_b).exp2_()  # P * l
                if careful:   # (as the forward: a masked score is 0, whatever q.k was)
                    p.masked_fill_(bias == -math.inf, 0.0)
                    if key_mask is not None:
                        p.masked_fill_(~key_mask[b, j0:j1].view(1, 1, 1, bn), 0.0)
                dv_t[:, j0:j1].baddbmm_(s.transpose(1, 2), dob)
                if bn < BN:  # columns bn..BN hold the previous tile: the skewed sums need zeros
                    skew.as_strided((n, G, bm, BN - bn), hstr + (W, 1), bn).zero_()
                # dP = dO v^T straight into the padded buffer, then dS = P * (dP - delta) in place
                ds = skew.as_strided((n, G * bm, bn), (G * bm * W, W, 1))
                torch.bmm(dob, vb.transpose(1, 2), out=ds)
                ds.view(n, G, bm, bn).sub_(delta_b).mul_(p)
                if careful:   # a masked score has dS = 0 even in a row whose delta is NaN
                    ds.view(n, G, bm, bn).masked_fill_(bias == -math.inf, 0.0)
                    if key_mask is not None:
                        ds.view(n, G, bm, bn).masked_fill_(~key_mask[b, j0:j1].view(1, 1, 1, bn), 0.0)
                m0 = (Nq - i1) + j0
                dsum_t[..., m0:m0 + bn + bm - 1] += skew.as_strided(
                    (n, G, bm, bn + bm - 1), hstr + (W - 1, 1)).sum(2)
                rows_t += skew.as_strided((n, G, bm, bn), hstr + (W, 1)).sum(-1, dtype=torch.float64)
                dqb.baddbmm_(ds, kb)
                dk_t[:, j0:j1].baddbmm_(ds.transpose(1, 2), qb, alpha=1 / LOG2E)  # qb carried log2 e
            dq[b, h0:h1, :, i0:i1] = dqb.view(n, G, bm, D).flip(-2).mul_(scale)
            row_ds[b, h0:h1, :, i0:i1] = rows_t.flip(-1)
        return dk_t, dv_t, dsum_t

    def add(item, dk_t, dv_t, dsum_t):
        b, h0, h1, _ = item
        dk[b, h0:h1] += dk_t
        dv[b, h0:h1] += dv_t
        dsum[b, h0:h1] += dsum_t

    gather_items(items, shared, run, add, B * Hq * Nq * Nk)
    dsum = dsum.sum(0).reshape(Hq, L)
    row_ds = row_ds.reshape(B, Hq, Nq)
    anchor = _row_anchors(table2.reshape(Hq, L), Nq, Nk, causal, q_offset, k_offset)  # [Hq, Nq]
    if not row_anchor:   # the block API: k is one block of each row's keys
        row_ds = torch.zeros_like(row_ds)
    dparams = torch.zeros(Hq, prior.traits.num_grads, dtype=cdt, device=dev)
    for g, dtable in enumerate(dtables):
        # where(): a derivative may be inf/nan at a distance no visible score has
        contrib = torch.where(dsum != 0, dsum * dtable.double(), torch.zeros_like(dsum))
        # minus, per row, (sum_j dS) * d bias / d param at the row's anchor: 0 in exact arithmetic
        # (dS sums to 0 over a row), it removes the float32 rounding left in that sum times a
        # derivative of large magnitude (every key of a row deep in the tail: 5e5 at 500 from mu)
        at_anchor = dtable.double().gather(1, anchor)
        correction = (row_ds * torch.where(row_ds != 0, at_anchor[None], 0.0)).sum((0, 2))
        dparams[:, g] = (contrib.sum(-1) - correction).to(cdt)
    return (dq.reshape(B, Hq, Nq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams)


def _row_anchors(table, Nq, Nk, causal, q_offset, k_offset):
    """int64 [Hq, Nq]: per head and query row, the table entry (distance) of the row's visible
    keys nearest the head's best entry: the distance a row's attention concentrates on when its
    prior is sharp (exactly so for a unimodal prior). Row i's keys j < kend_i sit at entries
    (Nq - 1 - i) + j."""
    best = torch.where(torch.isfinite(table), table, -math.inf).argmax(1, keepdim=True)   # [Hq, 1]
    rows = torch.arange(Nq, device=table.device)
    kend = (rows + q_offset - k_offset + 1).clamp(0, Nk) if causal else torch.full_like(rows, Nk)
    first = Nq - 1 - rows
    last = first + (kend - 1).clamp(min=0)
    return torch.minimum(torch.maximum(best, first[None]), last[None])
