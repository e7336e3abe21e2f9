"""The prior per distance, shared by both paths, and the per-row key counts n.

When the log-prior depends on the positions through d = i - j alone (traits.distance_table), it
is evaluated once per (head, distance) on the host, in float64, shifted per head, and rounded
once: the GPU kernels gather from the table (table strategy), the CPU path reads it as a bias
or as the entries its hooks take (docs/architecture.md, "Distance table").
"""
from __future__ import annotations

import math

import torch

from .constants import FLOAT32_MAX, TABLE_PAD
from .host_reads import HOST_READS, min_max, values


def distance_span(Nq, Nk, q_offset=0, k_offset=0, cu_seqlens_q=None, cu_seqlens_k=None):
    """(bottom, top): the smallest and the largest distance i - j between a query and a key of
    the call, before any mask. Offsets are ints or int tensors [B] (per batch row: the span of
    every row); with packed documents positions restart in each document, so the span is that of
    the longest documents. (A tensor offset or cu_seqlens is read on the host.)"""
    if cu_seqlens_q is not None:
        longest_q, longest_k = (HOST_READS.read(_longest, cu) for cu in (cu_seqlens_q, cu_seqlens_k))
        return -(max(longest_k, 1) - 1), max(longest_q, 1) - 1
    if isinstance(q_offset, int) and isinstance(k_offset, int):   # (no tensor operation)
        lo = hi = q_offset - k_offset
    else:   # (read once while the offsets are unchanged: host_reads)
        lo, hi = HOST_READS.read(_gap_min_max, q_offset, k_offset)
    return lo - (Nk - 1), hi + Nq - 1


def _longest(cu_seqlens) -> int:
    """The longest document's length (0 for none)."""
    bounds = HOST_READS.read(values, cu_seqlens)
    return max((end - start for start, end in zip(bounds, bounds[1:])), default=0)


def _gap_min_max(q_offset, k_offset) -> tuple[int, int]:
    """The smallest and largest q_offset - k_offset over the batch rows."""
    gap = torch.as_tensor(q_offset) - torch.as_tensor(k_offset)    # q_offset - k_offset per row
    return min_max(gap.reshape(-1))


def distance_prior(prior, pos_d, prm, with_grads=True):
    """(log_prior, d log_prior / d p for p in traits.table_grads) over distances pos_d, from the
    module's printed hook; (zeros,) for a prior without a log-prior term."""
    if prior.torch.distance_prior is None:
        return (torch.zeros_like(pos_d),)   # no log-prior term
    return prior.torch.distance_prior(pos_d, prm, with_grads)


def prior_tables(prior, theta, bottom, top, causal, with_grads, shifted=True):
    """The distance table of one call whose distances i - j span [bottom, top]
    (distance_span): [Hq, 1 + len(table_grads) * with_grads, n_dist] in theta's dtype (float32;
    float64 on the CPU path's float64 calls), n_dist = top - bottom + 1 + 2 * TABLE_PAD; entry t
    holds distance d_top - t (the newest first, so that a query's entries are consecutive along
    the keys), d_top = top + TABLE_PAD. Slot 0 holds log_prior(d) - shift_h, slot k + 1 the
    derivative in table_grads[k] (0 where the prior is -inf: P is 0 there; clamped to the
    float32 range: next to a kink it can overflow where dS is ~0). Returns (table, d_top).

    Evaluated in float64 from float64 parameters and exact integer distances, then rounded once.
    shift_h (shifted=True) is the largest finite log-prior over the distances the call's queries
    can see: softmax is blind to a constant per head, and a prior far from its mode (mu = 1e6, or
    queries at 2**23 against keys at 0) would otherwise hold values of 1e6 whose float32
    rounding swamps q.k. The block API (forward_block) passes shifted=False: blocks of one row
    must share their reference to merge."""
    Hq = theta.shape[0]
    d_top = top + TABLE_PAD
    n_dist = top - bottom + 1 + 2 * TABLE_PAD
    pos_d = d_top - torch.arange(n_dist, device=theta.device, dtype=torch.float64)
    prm = list(theta.double().unsqueeze(2).unbind(1))   # [Hq, 1] each: one cast, then views
    entries = [torch.as_tensor(e, device=theta.device, dtype=torch.float64).expand(Hq, n_dist)
               for e in distance_prior(prior, pos_d, prm, with_grads)]
    # the derivatives as one [Hq, G, n_dist] block: each step below is one operation for all of
    # them (T5's 32 buckets would otherwise take a hundred launches per call on a GPU)
    value = entries[0]
    grads = torch.stack(entries[1:], 1) if len(entries) > 1 else value.new_zeros(Hq, 0, n_dist)
    if shifted:
        lo, hi = (max(bottom, 0), top) if causal else (bottom, top)   # distances a query may see
        value, grads = shift_tables(value, grads, lo, hi, d_top)
    if not with_grads:
        return value.unsqueeze(1).to(theta.dtype).contiguous(), d_top
    live = (value > -math.inf).unsqueeze(1)
    grads = torch.where(live, grads, 0.0).clamp(-FLOAT32_MAX, FLOAT32_MAX)
    return torch.cat([value.unsqueeze(1), grads], 1).to(theta.dtype).contiguous(), d_top


def shift_tables(value, grads, lo, hi, d_top):
    """f(d) - f(d*) and g(d) - g(d*) per head, where d* is the distance with the largest finite
    log-prior f among those the call can see, [lo, hi] (float64; value [Hq, n_dist], grads the
    derivatives [Hq, G, n_dist]).

    The softmax of a row is blind to a constant per head, so f(d) - f(d*) gives the same
    attention with small numbers where the call's queries look (1e6 rounds to a step of 0.06 in
    float32). The shift depends on the parameters, but its gradient, g(d*) times the sum of dS
    over a row, is 0 (dS sums to 0 over every row); the derivative tables drop it too, so that
    a derivative such as ALiBi's |d| / b**2 at d ~ 2**23 does not multiply the float32 rounding
    left in that sum."""
    if lo > hi:
        return value, grads
    seen = value[:, d_top - hi:d_top - lo + 1]
    finite = torch.where(torch.isfinite(seen), seen, -math.inf)
    best = finite.argmax(1, keepdim=True)
    shift = finite.gather(1, best)
    # a head whose visible prior is -inf everywhere sees nothing: keep it so (no -inf - -inf);
    # a NaN parameter keeps its NaN (a NaN shift), for the output to show it
    shift = torch.where(torch.isinf(shift), torch.zeros_like(shift), shift)
    shift = torch.where(torch.isnan(seen).any(1, keepdim=True), math.nan, shift)
    where = best.unsqueeze(1).expand(-1, grads.shape[1], -1)
    at_best = grads[:, :, d_top - hi:d_top - lo + 1].gather(2, where)
    return value - shift, grads - torch.where(torch.isfinite(at_best), at_best, 0.0)


def row_key_counts(prior, B, Nq, Nk, q_offset, k_offset, causal, device, n=None, key_mask=None,
                   cu_seqlens_q=None, cu_seqlens_k=None):
    """n of every query row as float32 [B, Nq] (a stride-0 view over B where rows agree): the
    keys it sees after the causal rule, its document and key_mask. Given n (the block API: the
    row's count over all blocks of its keys), that. A placeholder where the prior does not read
    n. Offsets: ints or int tensors [B]."""
    if n is not None:
        n = torch.as_tensor(n, device=device).to(torch.float32)
        if n.dim() == 1:
            n = n[None]
        return n.expand(B, Nq) if n.shape != (B, Nq) else n.contiguous()
    if not prior.traits.uses_n:
        # (the kernels address a row's count at NRow + row whether the prior reads it or not,
        # so the placeholder spans the rows; empty, not zeros: a fill is a launch a call)
        return torch.empty(1, Nq, device=device, dtype=torch.float32).expand(B, Nq)
    rows = torch.arange(Nq, device=device, dtype=torch.int64)
    if cu_seqlens_q is not None:     # packed documents, B == 1: positions restart per document
        cu_q, cu_k = cu_seqlens_q.to(device, torch.int64), cu_seqlens_k.to(device, torch.int64)
        doc = torch.searchsorted(cu_q[1:], rows, right=True)
        start, length = cu_k[doc], cu_k[doc + 1] - cu_k[doc]
        kend = (rows - cu_q[doc] + 1).clamp(min=0).minimum(length) if causal else length
        start, kend = start[None], kend[None]
    else:
        gap = (torch.as_tensor(q_offset, device=device) - torch.as_tensor(k_offset, device=device))
        gap = gap.reshape(-1, 1).to(torch.int64)                          # [B or 1, 1]
        kend = (rows[None] + gap + 1).clamp(0, Nk) if causal else torch.full((1, Nq), Nk, device=device)
        start = torch.zeros_like(kend)
    if key_mask is None:
        counts = kend
    else:   # the unmasked keys among [start, start + kend)
        seen = torch.nn.functional.pad(torch.cumsum(key_mask.to(torch.int64), -1), (1, 0))  # [B, Nk + 1]
        counts = seen.gather(1, (start + kend).expand(B, Nq)) - seen.gather(1, start.expand(B, Nq))
    return counts.to(torch.float32).expand(B, Nq)


def acc_dtype(t):
    """The CPU path computes in float64 for float64 inputs (torch.autograd.gradcheck), else in
    float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
