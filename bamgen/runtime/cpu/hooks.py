"""The prior's printed torch code as the CPU path calls it: the logit and its derivatives per
score, and the distance tables of a prior in d alone."""
from __future__ import annotations

import math

import torch

from ..checks import MAX_POSITION
from ..constants import FLOAT32_MAX, POSITION_TABLE_SPAN, TABLE_PAD
from ..tables import distance_span, prior_tables
from .common import tile_entries


def logit_grads(prior, s, pos_d, pos_i, pos_j, pos_n, prm):
    """(logit, d logit / d s, d logit / d param for each learnable param) for a block, from the
    printed hook. A parameter derivative may overflow float32 next to a kink (|d - mu| a
    denormal); where it does, dS is ~0, so clamping to the largest float keeps dS * derivative
    finite."""
    outputs = prior.torch.logit_grads(s, pos_d, pos_i, pos_j, pos_n, prm)
    return (*outputs[:2], *(torch.clamp(torch.as_tensor(g), -FLOAT32_MAX, FLOAT32_MAX)
                            for g in outputs[2:]))


def table_logit(prior, s, tab_v, pos_d, pos_i, pos_j, pos_n, prm):
    """The logit with the log-prior read from the distance table (tab_v): s + tab_v for a prior
    whose score is s + log_prior, else the printed hook. A log-prior of -inf hides its key
    whatever the score makes of it (as the Triton kernels)."""
    if prior.torch.table_logit is None:   # (score s + log_prior: integer positions' tables)
        return s + tab_v
    return torch.where(tab_v == -math.inf, -math.inf,
                       prior.torch.table_logit(s, tab_v, pos_d, pos_i, pos_j, pos_n, prm))


def table_logit_grads(prior, s, tab_v, tabs, pos_d, pos_i, pos_j, pos_n, prm):
    """(logit, d logit / d s, d logit / d param for each learnable param), the log-prior and its
    derivatives read from the distance table (tab_v; tabs[k] for traits.table_grads[k]). (The
    logit here is not the one P is rebuilt from: the backward takes table_logit's, with its -inf
    rule, and leaves this one unused.)"""
    if prior.torch.table_logit_grads is None:   # score s + log_prior
        return (s + tab_v, 1.0, *tabs)
    outputs = prior.torch.table_logit_grads(s, tab_v, tabs, pos_d, pos_i, pos_j, pos_n, prm)
    return (*outputs[:2], *(torch.clamp(torch.as_tensor(g), -FLOAT32_MAX, FLOAT32_MAX)
                            for g in outputs[2:]))


def generic_tables(prior, theta, Nq, Nk, q_offset, k_offset, causal, grads, shifted):
    """The generic path's distance tables: [value [Hq, L], d value / d p for p in prior.traits.table_grads]
    (see distance_entries), or None where the per-score formula is evaluated instead (a
    log-prior that reads i, j or n; or a logit s + f(d), which takes the table path)."""
    if prior.traits.distance_table and not prior.traits.score_is_s:
        return distance_entries(prior, theta, Nq, Nk, q_offset, k_offset, causal, grads, shifted)
    return None


def distance_entries(prior, theta, Nq, Nk, q_offset, k_offset, causal, grads, shifted=True):
    """[value [Hq, L], then d value / d p [Hq, L] for p in prior.traits.table_grads when grads] over the
    call's L = Nq + Nk - 1 distances (entry m holds d = dmax - m), from prior_tables; the value
    is -inf where the causal mask hides a distance."""
    L = Nq + Nk - 1
    bottom, top = distance_span(Nq, Nk, q_offset, k_offset)
    tables, d_top = prior_tables(prior, theta, bottom, top, causal, grads, shifted)
    entries = [tables[:, slot, TABLE_PAD:TABLE_PAD + L].contiguous() for slot in range(tables.shape[1])]
    if causal:
        dmax = d_top - TABLE_PAD
        entries[0][:, max(0, dmax + 1):] = -math.inf   # entries m > dmax hold d < 0
    return entries


def distance_tables(prior, theta, Nq, Nk, q_offset, k_offset, causal, grads, shifted=True):
    """(bias [Hq, L], [d bias / d param [Hq, L] for each learnable param]) for a logit s + f(d):
    see distance_entries."""
    table, *by_slot = distance_entries(prior, theta, Nq, Nk, q_offset, k_offset, causal, grads, shifted)
    dtables = []
    if grads:
        zero = torch.zeros_like(table)
        by_name = dict(zip(prior.traits.table_grads, by_slot))
        dtables = [by_name.get(label, zero) for label in prior.traits.grad_labels]
    return table, dtables


class PositionTables:
    """The distance tables of a call whose positions are integers: the float64 tables the same
    prior gives token positions (prior_tables), over the distances the positions span, read per
    score at d = pos_i - pos_j instead of at a tile's offsets (entries[k] [Hq, L], entry m
    holding d = dmax - m)."""

    def __init__(self, entries, dmax):
        self.entries, self.dmax = entries, dmax

    def at(self, h0, h1, G, pos_d):
        """The entries of query heads h0 * G .. h1 * G at a tile's distances pos_d
        [h1 - h0, G, rows, keys]: one tensor of that shape per table."""
        rows = (h1 - h0) * G
        index = (self.dmax - pos_d).to(torch.int64).expand(h1 - h0, G, *pos_d.shape[2:])
        index = index.reshape(rows, -1)
        return [torch.gather(t[h0 * G:h1 * G], 1, index).view(index.shape[0] // G, G, *pos_d.shape[2:])
                for t in self.entries]


def position_tables(prior, theta, pos, grads, shifted):
    """PositionTables for a call's position tensors pos (pos_q, pos_k [B, Hq, N, 1]), or None
    where they do not apply: a prior that reads i, j or n, several channels, positions that are
    not all integers, or distances spanning more than POSITION_TABLE_SPAN * (Nq + Nk)."""
    traits = prior.traits
    if (not traits.distance_table or pos[0].shape[-1] != 1
            or len(traits.table_grads) != traits.num_grads):
        return None
    pos_q, pos_k = pos
    if pos_q.numel() == 0 or pos_k.numel() == 0:
        return None
    # (NaN fails p == p.round(), an infinity does not: isfinite)
    if not all(bool(((p == p.round()) & p.isfinite()).all()) for p in pos):
        return None
    q_lo, q_hi, k_lo, k_hi = (float(x) for x in (pos_q.min(), pos_q.max(), pos_k.min(), pos_k.max()))
    # (in float64: a finite float32 position may still be far past 2**24, 3e38 apart)
    top, bottom = q_hi - k_lo, q_lo - k_hi
    # (distances past 2**24 round in float32, where the entries are gathered: per score)
    if (max(abs(q_lo), abs(q_hi), abs(k_lo), abs(k_hi), abs(top), abs(bottom)) > MAX_POSITION
            or top - bottom + 1 > POSITION_TABLE_SPAN * (pos_q.shape[2] + pos_k.shape[2])):
        return None
    top, bottom = int(top), int(bottom)
    tables, d_top = prior_tables(prior, theta, bottom, top, False, grads, shifted)
    width = top - bottom + 1
    entries = [tables[:, slot, TABLE_PAD:TABLE_PAD + width].contiguous()
               for slot in range(tables.shape[1])]
    return PositionTables(entries, d_top - TABLE_PAD)


def entries_at(tables, h0, h1, G, Nq, i0, i1, j0, j1, pos_d):
    """A tile's table entries: by its distances pos_d from PositionTables, else by its offsets
    (tile_entries)."""
    if isinstance(tables, PositionTables):
        return tables.at(h0, h1, G, pos_d)
    return tile_entries(tables, h0, h1, G, Nq, i0, i1, j0, j1)
