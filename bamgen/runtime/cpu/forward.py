"""The CPU path's forward (backend="torch" on any device): blockwise attention in torch, memory
O(N * block) (docs/architecture.md, "CPU path")."""
from __future__ import annotations

import math

import torch

from ..constants import LOG2E
from ..tables import acc_dtype, row_key_counts
from . import common
from .common import (
    call_parts, doc_groups, empty_stats, hide_padding, inputs_finite, key_limit, masks_nothing,
    param_columns, positions, run_items, table_tile, tensor_positions, work_items)
from .hooks import distance_tables, entries_at, generic_tables, position_tables, table_logit


def forward(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted=True, n=None,
            key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, pos=None):
    """CPU forward: (out [B, Hq, Nq, D] in q's dtype, softmax statistics [B, Hq, Nq, 2]).

    The statistics are, per row, the base-2 row max m of z = logit * log2(e) and the sum
    l = sum_j exp2(z - m) (m = -inf, l = 0 for a row that sees no key): the backward rebuilds
    P = exp2(z - m) / l, exact for the largest z, where a rounded log-sum-exp m + log2(l) would
    be off by eps * |z| (a row whose every key sits far from the prior's mode has |z| ~ 1e6).
    pos: (pos_q [B, Hq, Nq, C], pos_k [B, Hq, Nk, C]) in the compute dtype, the positions as
    tensors (docs/positions.md; int offsets place the rows among the keys for the causal mask;
    packed documents taken), or None."""
    if pos is not None:
        out, stats = positional_f32(prior, q, k, v, theta, causal, scale, shifted, n, key_mask,
                                    cu_seqlens_q, cu_seqlens_k, pos, q_offset, k_offset)
        return out.to(q.dtype), stats
    out, stats = forward_f32(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted, n,
                             key_mask, cu_seqlens_q, cu_seqlens_k)
    return out.to(q.dtype), stats


def forward_f32(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted=True, n=None,
                key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """(out in the compute dtype, statistics): the parts of the call (call_parts), each by
    _forward_call. n: see _row_key_counts."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    parts = call_parts(B, Nq, Nk, q_offset, k_offset, cu_seqlens_q, cu_seqlens_k)
    if len(parts) == 1 and parts[0][1:6:2] == (B, Nq, Nk):
        return forward_call(prior, q, k, v, theta, causal, scale, parts[0][6], parts[0][7], shifted, n,
                            key_mask)
    cdt = acc_dtype(q)
    out = torch.zeros(q.shape, dtype=cdt, device=q.device)
    stats = empty_stats(B, Hq, 1, Nq, q.device, cdt).reshape(B, Hq, Nq, 2)
    if cu_seqlens_q is not None:   # packed: documents of similar lengths as batches
        for group in doc_groups(parts, causal, key_mask, q.device):
            out_g, stats_g = forward_call(prior, group.gather(q, 0), group.gather(k, 1),
                                          group.gather(v, 1), theta, causal, scale, 0, 0,
                                          shifted, None, group.key_mask)
            group.scatter(out, out_g, 0)
            group.scatter(stats, stats_g, 0)
        return out, stats
    for b0, b1, i0, i1, j0, j1, qo, ko in parts:
        if i1 > i0 and j1 > j0:
            km = None if key_mask is None else key_mask[b0:b1, j0:j1]
            out[b0:b1, :, i0:i1], stats[b0:b1, :, i0:i1] = forward_call(
                prior, q[b0:b1, :, i0:i1], k[b0:b1, :, j0:j1], v[b0:b1, :, j0:j1], theta, causal, scale, qo, ko,
                shifted, None, km)
    return out, stats


def positional_f32(prior, q, k, v, theta, causal, scale, shifted, n, key_mask, cu_seqlens_q,
                   cu_seqlens_k, pos, q_offset=0, k_offset=0):
    """forward_f32 of a call with position tensors: the generic path, packed documents as the
    batches of doc_groups, their positions gathered with their tokens (and offsets 0)."""
    if cu_seqlens_q is None:
        k, v = hide_padding(k.contiguous(), v.contiguous(), key_mask)
        return forward_generic(prior, q.contiguous(), k, v, theta, causal, scale, q_offset,
                               k_offset, shifted, n, key_mask, pos)
    B, Hq, Nq, D = q.shape
    cdt = acc_dtype(q)
    out = torch.zeros(q.shape, dtype=cdt, device=q.device)
    stats = empty_stats(B, Hq, 1, Nq, q.device, cdt).reshape(B, Hq, Nq, 2)
    parts = call_parts(B, Nq, k.shape[2], 0, 0, cu_seqlens_q, cu_seqlens_k)
    for group in doc_groups(parts, causal, key_mask, q.device):
        k_g, v_g = hide_padding(group.gather(k, 1), group.gather(v, 1), group.key_mask)
        out_g, stats_g = forward_generic(prior, group.gather(q, 0), k_g, v_g, theta, causal, scale,
                                         0, 0, shifted, None, group.key_mask,
                                         (group.gather(pos[0], 0), group.gather(pos[1], 1)))
        group.scatter(out, out_g, 0)
        group.scatter(stats, stats_g, 0)
    return out, stats


def forward_call(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted, n, key_mask):
    """One call with int offsets (and perhaps a key_mask): the fused table path, its tiles, or
    the generic path."""
    # Dense inputs: the fused CPU kernel of the table path assumes a unit stride along the head
    # dim (a transposed or sliced view gave garbage), and the tiles below read rows of q, k, v.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    k, v = hide_padding(k, v, key_mask)
    if prior.traits.table_path and key_mask is None and (
            masks_nothing(k.shape[2], causal, q_offset, k_offset) or inputs_finite(q, k)):
        return table_forward(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted)
    if prior.traits.table_path:
        return table_forward_tiles(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted,
                                   careful=True, key_mask=key_mask)
    return forward_generic(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted, n,
                           key_mask)


def forward_generic(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted=True, n=None,
                    key_mask=None, pos=None):
    """Blockwise online-softmax forward in float32 (base 2), the prior evaluated per score (from
    the float64 distance table where the log-prior is a function of d; from the position
    tensors pos where given, see forward()).
    Returns (out [B, Hq, Nq, D] float32, statistics [B, Hq, Nq, 2])."""
    B, Hq, Nq, D = q.shape
    cdt = acc_dtype(q)   # the compute dtype
    # the distance tables: of the positions where they are integers, of the offsets otherwise
    tables = position_tables(prior, theta, pos, False, shifted) if pos is not None else \
        generic_tables(prior, theta, Nq, k.shape[2], q_offset, k_offset, causal, False, shifted)
    counts = row_key_counts(prior, q.shape[0], Nq, k.shape[2], q_offset, k_offset, causal, q.device, n, key_mask)
    Hk, Nk = k.shape[1], k.shape[2]
    G = Hq // Hk
    dev = q.device
    qg = q.to(cdt).reshape(B, Hk, G, Nq, D)
    kf, vf = k.to(cdt), v.to(cdt)
    out = torch.zeros(B, Hk, G, Nq, D, dtype=cdt, device=dev)
    stats = empty_stats(B, Hk, G, Nq, dev, cdt)
    BM, BN = max(32, common.TORCH_BLOCK_M // G), common.TORCH_BLOCK_N  # a tile holds G * BM query rows

    def run(item):
        b, h0, h1, blocks = item
        n = h1 - h0
        prm = param_columns(theta, h0, h1, G)
        for i0 in blocks:
            i1 = min(Nq, i0 + BM)
            bm = i1 - i0
            qb = qg[b, h0:h1, :, i0:i1].mul(scale).reshape(n, G * bm, D)
            m = torch.full((n, G, bm), -math.inf, dtype=cdt, device=dev)
            l = torch.zeros_like(m)
            acc = torch.zeros(n, G * bm, D, dtype=cdt, device=dev)
            for j0 in range(0, key_limit(i1, Nk, causal, q_offset, k_offset), BN):
                j1 = min(Nk, j0 + BN)
                s = torch.bmm(qb, kf[b, h0:h1, j0:j1].transpose(1, 2)).view(n, G, bm, j1 - j0)
                pos_d, pos_i, pos_j, pos_n, visible = positions(
                    i0, i1, j0, j1, q_offset, k_offset, counts[b], causal, dev, cdt,
                    prior.traits.clamp_positions)
                if key_mask is not None:   # padding keys: never attended
                    km = key_mask[b, j0:j1][None, :]
                    visible = km if visible is None else visible & km
                if pos is not None:
                    pos_d, pos_i, pos_j = tensor_positions(pos, b, h0, h1, G, i0, i1, j0, j1)
                if tables is None:
                    logit = prior.torch.logit(s, pos_d, pos_i, pos_j, pos_n, prm)
                else:
                    tab_v, = entries_at(tables, h0, h1, G, Nq, i0, i1, j0, j1, pos_d)
                    logit = table_logit(prior, s, tab_v, pos_d, pos_i, pos_j, pos_n, prm)
                z = torch.mul(logit, LOG2E, out=s)
                if visible is not None:
                    z.masked_fill_(~visible, -math.inf)
                m_new = torch.maximum(m, z.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = z.sub_(m_safe[..., None]).exp2_()
                correction = torch.exp2(m - m_safe)
                l = l * correction + p.sum(-1)
                acc.mul_(correction.reshape(n, G * bm, 1))
                acc.baddbmm_(p.view(n, G * bm, -1), vf[b, h0:h1, j0:j1])
                m = m_new
            out[b, h0:h1, :, i0:i1] = acc.view(n, G, bm, D) / torch.where(l == 0, torch.ones_like(l), l)[..., None]
            stats[b, h0:h1, :, i0:i1, 0] = m
            stats[b, h0:h1, :, i0:i1, 1] = l

    first = max(0, k_offset - q_offset) if causal else 0   # rows before it see no key
    run_items(work_items(B, Hk, G, list(range(first, Nq, BM)))[0], run, B * Hq * Nq * Nk)
    return out.reshape(B, Hq, Nq, D), stats.reshape(B, Hq, Nq, 2)


def table_forward(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted=True):
    """Forward through torch's fused CPU flash kernel, one call per block of query rows and query
    head of a GQA group, the bias a strided view of the table. The kernel returns a natural-log
    LSE only, which the backward's recomputed z cannot match to the last bit: fine while
    |LSE| <= TORCH_FUSED_MAX_LSE (an error of a few eps * |z| in P), otherwise (every visible key of
    a row far from the prior's mode) the forward is redone by _table_forward_tiles, whose
    statistics the backward reproduces exactly. Returns (out float32, statistics)."""
    if common.FLASH_CPU is None or q.device.type != "cpu":
        return table_forward_tiles(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted)
    B, Hq, Nq, D = q.shape
    cdt = acc_dtype(q)   # the compute dtype
    Hk, Nk = k.shape[1], k.shape[2]
    G = Hq // Hk
    L = Nq + Nk - 1
    table, _ = distance_tables(prior, theta, Nq, Nk, q_offset, k_offset, causal, False, shifted)
    qg = q.to(cdt).reshape(B, Hk, G, Nq, D)
    kf, vf = k.to(cdt), v.to(cdt)
    out = torch.zeros(B, Hk, G, Nq, D, dtype=cdt, device=q.device)
    lse = torch.full((B, Hk, G, Nq), -math.inf, dtype=cdt, device=q.device)
    first = max(0, k_offset - q_offset) if causal else 0   # rows before it see no key
    block = common.TORCH_TABLE_FWD_BLOCK if causal else Nq

    def run(item):
        b, h0, h1, blocks = item
        for i0 in blocks:
            i1 = min(Nq, i0 + block)
            kend = key_limit(i1, Nk, causal, q_offset, k_offset)
            for g in range(G):
                mask = table.as_strided((1, h1 - h0, i1 - i0, kend), (0, G * L, 1, 1),
                                        table.storage_offset() + (h0 * G + g) * L + (Nq - i1))
                o, m = common.FLASH_CPU(qg[b:b + 1, h0:h1, g, i0:i1].flip(2), kf[b:b + 1, h0:h1, :kend],
                                 vf[b:b + 1, h0:h1, :kend], attn_mask=mask, scale=scale)
                out[b, h0:h1, g, i0:i1] = o[0].flip(1)
                lse[b, h0:h1, g, i0:i1] = m[0].flip(1)

    blocks = list(range(first, Nq, block))
    if B * Hq * Nq * Nk < common.TORCH_INLINE_SCORES:   # run inline (a decode step): one call per batch row
        items = [(b, 0, Hk, blocks) for b in range(B)]
    else:
        items = work_items(B, Hk, G, blocks)[0]
    run_items(items, run, B * Hq * Nq * Nk)
    # A row whose every visible key has a log-prior of -inf (outside a prior's window) sees no
    # key; the fused kernel reports LSE 0 and output 0 there: make it (-inf, 0) as elsewhere.
    dead = ~_rows_with_keys(table, Nq, Nk, causal, q_offset, k_offset).reshape(Hk, G, Nq)
    if bool(dead.any()):
        lse.masked_fill_(dead, -math.inf)
        out.masked_fill_(dead[..., None], 0.0)
    seen = lse[..., first:]
    if seen.numel() and bool((seen.abs() > common.TORCH_FUSED_MAX_LSE).any()):
        return table_forward_tiles(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted)
    stats = torch.stack([lse * LOG2E, torch.isfinite(lse).to(cdt)], -1)  # m = LSE (base 2), l = 1
    return out.reshape(B, Hq, Nq, D), stats.reshape(B, Hq, Nq, 2)


def _rows_with_keys(table, Nq, Nk, causal, q_offset, k_offset):
    """bool [Hq, Nq]: whether query row i sees a key whose table entry (log-prior) is above -inf.
    Row i's keys j < kend_i sit at entries (Nq - 1 - i) + j: a prefix count of finite entries
    answers every row at once."""
    finite = torch.isfinite(table).to(torch.int64)
    count = torch.nn.functional.pad(torch.cumsum(finite, 1), (1, 0))      # count[:, m] = sum below m
    rows = torch.arange(Nq, device=table.device)
    if causal:
        kend = (rows + q_offset - k_offset + 1).clamp(0, Nk)
    else:
        kend = torch.full_like(rows, Nk)
    start = Nq - 1 - rows
    return (count[:, start + kend] - count[:, start]) > 0


def table_forward_tiles(prior, q, k, v, theta, causal, scale, q_offset, k_offset, shifted=True,
                        careful=False, key_mask=None):
    """Online-softmax forward over the backward's own tiles (same rows, reversal, scale, bias and
    GEMM shapes), so that z = s2 + bias2 and the statistics are bit-for-bit the backward's.
    careful (non-finite q or k): masked scores are set to -inf, not added to (see
    inputs_finite)."""
    B, Hq, Nq, D = q.shape
    cdt = acc_dtype(q)   # the compute dtype
    Hk, Nk = k.shape[1], k.shape[2]
    G = Hq // Hk
    L = Nq + Nk - 1
    dev = q.device
    table, _ = distance_tables(prior, theta, Nq, Nk, q_offset, k_offset, causal, False, shifted)
    table2 = table.mul_(LOG2E).view(Hk, G, L)
    qg = q.to(cdt).reshape(B, Hk, G, Nq, D)
    kf, vf = k.to(cdt), v.to(cdt)
    out = torch.zeros(B, Hk, G, Nq, D, dtype=cdt, device=dev)
    stats = empty_stats(B, Hk, G, Nq, dev, cdt)
    BM, BN = table_tile(Nq, Nk, G)
    scale2 = scale * LOG2E
    first = max(0, k_offset - q_offset) if causal else 0

    def run(item):
        b, h0, h1, blocks = item
        n = h1 - h0
        s_buf = torch.empty(n * G * BM * BN, dtype=cdt, device=dev)
        tab = table2[h0:h1]
        for i0 in blocks:
            i1 = min(Nq, i0 + BM)
            bm = i1 - i0
            qb = qg[b, h0:h1, :, i0:i1].flip(-2).mul_(scale2).reshape(n, G * bm, D)
            m = torch.full((n, G, bm), -math.inf, dtype=cdt, device=dev)
            l = torch.zeros_like(m)
            acc = torch.zeros(n, G * bm, D, dtype=cdt, device=dev)
            for j0 in range(0, key_limit(i1, Nk, causal, q_offset, k_offset), BN):
                j1 = min(Nk, j0 + BN)
                bn = j1 - j0
                s = torch.bmm(qb, kf[b, h0:h1, j0:j1].transpose(1, 2),
                              out=s_buf[:n * G * bm * bn].view(n, G * bm, bn))
                bias = tab.as_strided((n, G, bm, bn), (G * L, L, 1, 1),
                                      tab.storage_offset() + (Nq - i1) + j0)
                z = s.view(n, G, bm, bn).add_(bias)
                if careful:
                    z.masked_fill_(bias == -math.inf, -math.inf)
                if key_mask is not None:   # padding keys: never attended
                    z.masked_fill_(~key_mask[b, j0:j1].view(1, 1, 1, bn), -math.inf)
                m_new = torch.maximum(m, z.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = z.sub_(m_safe[..., None]).exp2_()
                correction = torch.exp2(m - m_safe)
                l = l * correction + p.sum(-1)
                acc.mul_(correction.reshape(n, G * bm, 1))
                acc.baddbmm_(s, vf[b, h0:h1, j0:j1])
                m = m_new
            acc = acc.view(n, G, bm, D) / torch.where(l == 0, torch.ones_like(l), l)[..., None]
            out[b, h0:h1, :, i0:i1] = acc.flip(-2)
            stats[b, h0:h1, :, i0:i1, 0] = m.flip(-1)
            stats[b, h0:h1, :, i0:i1, 1] = l.flip(-1)

    run_items(work_items(B, Hk, G, list(range(first, Nq, BM)))[0], run, B * Hq * Nq * Nk)
    return out.reshape(B, Hq, Nq, D), stats.reshape(B, Hq, Nq, 2)
