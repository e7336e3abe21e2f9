"""The prior's printed torch code as the CPU path calls it: the logit and its derivatives per
score, and the distance tables of a prior in d alone."""
from __future__ import annotations

import math

import torch

from ..constants import FLOAT32_MAX, TABLE_PAD
from ..tables import distance_span, prior_tables


def logit_grads(prior, s, pos_d, pos_i, pos_j, pos_n, prm):
    """(logit, d logit / d s, d logit / d param for each learnable param) for a block, from the
    printed hook. A parameter derivative may overflow float32 next to a kink (|d - mu| a
    denormal); where it does, dS is ~0, so clamping to the largest float keeps dS * derivative
    finite."""
    outputs = prior.torch.logit_grads(s, pos_d, pos_i, pos_j, pos_n, prm)
    return (*outputs[:2], *(torch.clamp(torch.as_tensor(g), -FLOAT32_MAX, FLOAT32_MAX)
                            for g in outputs[2:]))


def table_logit(prior, s, tab_v, pos_d, pos_i, pos_j, pos_n, prm):
    """The logit with the log-prior read from the distance table (tab_v), for a score other than
    s + log_prior. A log-prior of -inf hides its key whatever the score makes of it (as the
    Triton kernels)."""
    return torch.where(tab_v == -math.inf, -math.inf,
                       prior.torch.table_logit(s, tab_v, pos_d, pos_i, pos_j, pos_n, prm))


def table_logit_grads(prior, s, tab_v, tabs, pos_d, pos_i, pos_j, pos_n, prm):
    """(logit, d logit / d s, d logit / d param for each learnable param), the log-prior and its
    derivatives read from the distance table (tab_v; tabs[k] for traits.table_grads[k]). (The
    logit here is not the one P is rebuilt from: the backward takes table_logit's, with its -inf
    rule, and leaves this one unused.)"""
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
