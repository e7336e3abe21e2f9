"""The CPU path's decode step (a generation step with a KV cache): at most TORCH_DECODE_ROWS
query rows, no backward to follow, a logit s + f(d) (the distance-table path's priors). The
general path pays per call for what a step does not need: the distance table rebuilt in
float64 (1-2 ms for 8 heads at 4096 keys), one fused-kernel call per batch row and GQA head,
statistics checks. A step here is one call of the fused kernel, its mask a view of a bias
table that lives across steps (DecodeTables, one per prior: Prior.decode_tables).

decode() answers None where the call is not a decode step (or the prior has no distance
table) and the general path runs instead.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from ..constants import FLOAT32_MAX, LOG2E
from ..tables import distance_prior
from . import common
from .common import call_parts, hide_padding, inputs_finite, masks_nothing

TORCH_DECODE_ROWS = 16          # query rows of a decode step at most
TORCH_DECODE_CHUNK = 1 << 14    # (heads x distances) of one table chunk: one op, one thread
TORCH_DECODE_TABLES = 64        # parameter sets kept (a model's layers), least recently used out


class DecodeTable:
    """The bias of decode steps for one set of parameter values: f(d) per (head, distance) in
    float64 by chunks of distances, and the float32 bias f(d) - shift_h built from them.

    A generation step needs f(d) for one more distance than the step before, and a shift
    (_shift_tables: the largest finite f over the distances the call's queries can see) over a
    span one longer; rebuilding both per step cost more than the attention. Here f is evaluated
    once per chunk of distances [c C, (c + 1) C), each chunk by the same operations on a tensor
    of the same shape, small enough (heads x C <= TORCH_DECODE_CHUNK, under torch's grain size)
    never to be split across threads: an entry has the same bits whichever step computed it.
    The shift of a span that extends the last one is the larger of the last shift and the new
    distances' maximum, and a maximum is exact: a step's bias does not depend on the steps
    before it. Only the chunks of the latest call are kept."""

    def __init__(self, prior, theta):
        Hq = theta.shape[0]
        self.prior = prior
        self.size = 1 << max(4, (TORCH_DECODE_CHUNK // max(Hq, 1)).bit_length() - 1)
        self.prm = list(theta.detach().double().unsqueeze(2).unbind(1))   # [Hq, 1] each
        self.heads = Hq
        # chunk -> (f(d) ascending [Hq, C] float64, the same with -inf for non-finite values,
        # whether it holds a NaN, whether it holds a -inf)
        self.chunks = {}
        self.span, self.best = None, None     # the last shifted span [lo, hi] and its maxima
        self.shift, self.shift_key = None, None
        self.table = None    # (chunk range, shift_key, float32 f - shift newest first, has -inf)

    def bias(self, bottom, top, lo, hi):
        """(table, start, whether it holds a -inf): table[:, start + t] (float32 [Hq, ...]) is
        f(d) - shift_h for d = top - t, t = 0 .. top - bottom (newest first, as the distance
        table), shift_h the largest finite f(d) over [lo, hi] (none: 0); None where f is NaN at a
        distance of the call (the general path says how). The caller views the span it needs:
        a slice here would be one more torch operation per step."""
        wanted = range(bottom // self.size, top // self.size + 1)
        if self.table is None or self.table[0] != wanted:
            self.chunks = {c: self.chunks[c] if c in self.chunks else self._evaluate(c) for c in wanted}
        if any(self.chunks[c][2] for c in wanted):
            return None
        self._update_shift(lo, hi)
        if self.table is None or self.table[:2] != (wanted, self.shift_key):
            f32 = [(self.chunks[c][0] - self.shift).float() for c in wanted]   # ascending
            table = (torch.cat(f32, 1) if len(f32) > 1 else f32[0]).flip(1)
            self.table = (wanted, self.shift_key, table, any(self.chunks[c][3] for c in wanted))
        return self.table[2], (wanted[-1] + 1) * self.size - 1 - top, self.table[3]

    def _evaluate(self, chunk):
        pos_d = torch.arange(chunk * self.size, (chunk + 1) * self.size, dtype=torch.float64)
        value = distance_prior(self.prior, pos_d, self.prm, with_grads=False)[0]
        value = torch.as_tensor(value, dtype=torch.float64).expand(self.heads, self.size).contiguous()
        finite = torch.where(torch.isfinite(value), value, -math.inf)
        return value, finite, bool(torch.isnan(value).any()), bool((value == -math.inf).any())

    def _range_max(self, lo, hi):
        """float64 [Hq, 1]: the largest finite f(d) over d in [lo, hi] (-inf: none)."""
        parts = []
        for c in range(lo // self.size, hi // self.size + 1):
            first = max(lo - c * self.size, 0)
            parts.append(self.chunks[c][1][:, first:min(hi - c * self.size + 1, self.size)].amax(1, keepdim=True))
        return torch.cat(parts, 1).amax(1, keepdim=True) if len(parts) > 1 else parts[0]

    def _update_shift(self, lo, hi):
        """shift_h over [lo, hi] (_shift_tables' rule), from the last span's maxima where this
        span extends it (a decode step: one more distance)."""
        last = self.span if self.span is not None and self.span[0] <= self.span[1] else None
        if lo > hi:
            best = torch.full((self.heads, 1), -math.inf, dtype=torch.float64)
        elif last == (lo, hi):
            best = self.best
        elif last is not None and last[0] == lo and last[1] < hi:       # grown at the top
            best = torch.maximum(self.best, self._range_max(last[1] + 1, hi))
        elif last is not None and last[1] == hi and lo < last[0]:       # grown at the bottom
            best = torch.maximum(self.best, self._range_max(lo, last[0] - 1))
        else:
            best = self._range_max(lo, hi)
        if best is not self.best:
            self.shift = torch.where(torch.isinf(best), 0.0, best)
            self.shift_key = self.shift.numpy().tobytes()
        self.span, self.best = (lo, hi), best


class DecodeTables:
    """The DecodeTable of every parameter set in use (a model's layers each have theirs),
    keyed by the parameters' bits; the least recently used go past TORCH_DECODE_TABLES."""

    def __init__(self, prior):
        self.prior = prior
        self.lock = threading.Lock()
        self.tables = OrderedDict()

    def bias(self, theta, bottom, top, lo, hi):
        key = (theta.dtype, tuple(theta.shape), theta.numpy().tobytes())   # (theta is detached)
        with self.lock:
            table = self.tables.pop(key, None) or DecodeTable(self.prior, theta)
            self.tables[key] = table
            while len(self.tables) > TORCH_DECODE_TABLES:
                self.tables.popitem(last=False)
            return table.bias(bottom, top, lo, hi)



def decode_mask(prior, theta, Hk, G, Nq, Nk, q_offset, k_offset, causal):
    """The additive mask of a decode call with int offsets, a view [Hk, G, Nq, Nk] (query rows
    reversed: row i of the call is row Nq - 1 - i here; [1, Hk, G, Nk] for one row, the shape
    the fused kernel takes), and whether it holds a -inf; None where f is NaN somewhere in the
    call.

    The bias table is f(d) - shift_h newest first (entry t for distance top - t), -inf where the
    causal rule hides the distance (as distance_entries); reversed row r sees key j at
    entry r + j, so the mask is a Hankel view of the table (strides 1, 1)."""
    bottom, top = q_offset - k_offset - (Nk - 1), q_offset - k_offset + Nq - 1   # _distance_span
    lo, hi = (max(bottom, 0), top) if causal else (bottom, top)
    got = prior.decode_tables.bias(theta, bottom, top, lo, hi)
    if got is None:
        return None
    table, start, neginf = got
    if causal and bottom < 0:   # queries before keys: the distances below 0 hidden
        table = table[:, start:start + top - bottom + 1].clone()
        table[:, max(top + 1, 0):] = -math.inf
        start, neginf = 0, True
    row, base = table.stride(0), table.storage_offset() + start
    if Nq == 1:
        return table.as_strided((1, Hk, G, Nk), (0, G * row, row, 1), base), neginf
    return table.as_strided((Hk, G, Nq, Nk), (G * row, row, 1, 1), base), neginf


def _decode_padding(q, k, v, key_mask, scale):
    """k and v of a decode step with key_mask: as they are where no padding key can disturb a
    row, else with the padding read as 0 (hide_padding). The mask's -inf gives a padding
    key weight 0 if its score is finite and its v too: 0 * NaN, and inf + -inf from a score
    that overflows (uninitialised memory can hold 1e38), would reach every row. So the padding
    slots' v must be finite and |q.k| * scale must stay below float32's largest, which
    D * max|q| * max|k_pad| * scale bounds. Only the padding slots are read: a copy of the
    cache per step would cost more than the attention."""
    b, j = (~key_mask).nonzero(as_tuple=True)
    if not len(b):
        return k, v
    k_pad, v_pad = k[b, :, j].float(), v[b, :, j].float()
    bound = q.shape[-1] * scale * float(q.abs().amax()) * float(k_pad.abs().amax())
    if bound < FLOAT32_MAX and bool(torch.isfinite(v_pad).all()):   # (NaN: not below)
        return k, v
    return hide_padding(k, v, key_mask)


def decode(prior, q, k, v, theta, causal, scale, layout, stats=True):
    """(out in q's dtype, statistics) of a decode step on the CPU, or None where the call is not
    one (more than TORCH_DECODE_ROWS rows, packed documents, another device, float64 inputs, a
    NaN or inf in q or k where a score is hidden) and the general path runs. Statistics as
    forward's: the base-2 row max and sum, here m = the row's log-sum-exp, l = 1.
    stats=False: (out,), for a caller that drops them.

    One call of torch's fused CPU attention kernel with the prior's bias as its mask: the
    query heads of a GQA group are rows of their KV head, so K and V are read once per step,
    in place where their head dim is unit-stride (a static cache's slice is not copied). Each
    torch operation around it costs 10-30 us once K and V have swept the caches, so a plain
    step (one row, one offset, no key_mask) makes only the kernel call and two views."""
    if not prior.traits.table_path:
        return None   # no distance table to keep across steps: the general path
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    if (common.FLASH_CPU is None or Nq > TORCH_DECODE_ROWS or layout.cu_seqlens_q is not None
            or q.device.type != "cpu" or q.dtype == torch.float64 or theta.dtype != torch.float32):
        return None
    G = Hq // Hk
    parts = call_parts(B, Nq, Nk, layout.q_offset, layout.k_offset, None, None)
    masks = [decode_mask(prior, theta, Hk, G, Nq, Nk, qo, ko, causal) for *_, qo, ko in parts]
    if any(mask is None for mask in masks):
        return None
    if causal and not all(masks_nothing(Nk, causal, qo, ko) for *_, qo, ko in parts):
        first_hidden = min(max(0, qo - ko + 1) for *_, qo, ko in parts)   # of row 0
        if not inputs_finite(q, k[:, :, first_hidden:]):
            return None   # a NaN in q, or in a key some row does not see: the general path
    key_mask = layout.key_mask
    if key_mask is not None:
        k, v = _decode_padding(q, k, v, key_mask, scale)
    if len(parts) == 1 and key_mask is None and Nq == 1:
        mask = masks[0][0]     # [1, Hk, G, Nk] (rows of a group: a view, nothing copied)
    else:
        mask = torch.empty(B, Hk, G, Nq, Nk, dtype=torch.float32)
        for (b0, b1, *_), (view, _) in zip(parts, masks):
            mask[b0:b1] = view.view(Hk, G, Nq, Nk)
        if key_mask is not None:
            mask.masked_fill_(~key_mask.view(B, 1, 1, 1, Nk), -math.inf)
        mask = mask.view(B, Hk, G * Nq, Nk)
    if Nq > 1:
        q = q.flip(2).reshape(B, Hk, G * Nq, D)
    elif G > 1:
        q = q.reshape(B, Hk, G, D)
    # float32, and unit stride along the head dim, the one stride the kernel does not read (a
    # transposed or strided view would give garbage); other strides are taken as they come
    f32 = [t if t.dtype == torch.float32 else t.float() for t in (q, k, v)]   # (strides kept)
    f32 = [t if t.stride(-1) == 1 else t.contiguous() for t in f32]
    out, lse = common.FLASH_CPU(*f32, attn_mask=mask, scale=scale)
    if Nq > 1:
        out = out.view(B, Hk, G, Nq, D).flip(3)
    out = out.reshape(B, Hq, Nq, D) if (G > 1 or Nq > 1) else out
    out = out if out.dtype == q.dtype else out.to(q.dtype)
    if not stats:
        return (out,)
    stats = torch.stack([lse.mul_(LOG2E), torch.ones_like(lse)], -1)
    if key_mask is not None or any(neginf for _, neginf in masks):
        dead = mask.amax(-1) == -math.inf    # a row that sees no key: (m, l) = (-inf, 0)
        stats.masked_fill_(dead[..., None], 0.0)
        stats[..., 0].masked_fill_(dead, -math.inf)
    stats = stats.view(B, Hk, G, Nq, 2)
    if Nq > 1:
        stats = stats.flip(3)
    return out, stats.reshape(B, Hq, Nq, 2)
