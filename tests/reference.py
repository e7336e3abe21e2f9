"""Naive attention-with-a-positional-prior reference (docs/architecture.md, "Testing").

This module is deliberately independent of the compiler: it imports nothing from ``bamgen`` or
``generated``, and the prior reaches it only as plain torch callables written by the test that
uses it.  Everything is materialised (the full ``[B, Hq, Nq, Nk]`` logit tensor), so it is only
meant for the small shapes of the tests.

Math (the contract of docs/architecture.md, "The generated module")::

    i_abs = i + q_offset, j_abs = j + k_offset, d = i_abs - j_abs
    s     = scale * q_i . k_j                      (scale defaults to 1 / sqrt(D))
    lp    = log_prior(d, params_of_query_head)
    logit = score(s, lp, n, params)                (default: s + lp)
    visible(i, j) = j_abs <= i_abs if causal else True
    n_i   = number of visible keys of row i
    out_i = sum_j softmax_j(logit_ij over visible j) v_j ;  0 for a row with no visible key

The same function computes two things:

* ``ref``: ``compute_dtype=torch.float64`` — the exact answer (up to float64 rounding) for the
  given, already rounded, inputs.
* ``pt``: ``compute_dtype=`` the test dtype — "the same naive math in the test dtype", the
  yardstick of FlashAttention's tolerance scheme.  It follows FlashAttention's own ``attention_ref``
  with ``upcast=False``: q·k and P·v run in the test dtype, the prior (and its parameters) in
  float32, and ``s + lp`` is therefore promoted to float32 before the softmax, exactly as
  ``scores + attn_bias`` is in FlashAttention's ALiBi tests.  For float32 inputs every step is
  float32.

Parameter gradients and the kink convention
-------------------------------------------
Every prior parameter is expanded into a *per-element* leaf tensor of shape ``[Hq, Nq, Nk]`` (one
copy per logit position, shared across the batch), so that autograd gives the per-element
contribution ``sum_b dS_bhij * dlogit_hij/dtheta``.  The contract says that the derivative of
``|x|`` at ``x = 0`` is 0 and that a product with that zero stays 0 even if the other factor is
infinite (``(|d - mu| / alpha) ** beta`` with ``beta < 1`` at ``d == mu``), and that
``0 * log 0 = 0``.  Autograd gives NaN (``0 * inf``) at exactly those points, so NaN contributions
are replaced by 0 **only** where the element is a declared kink point (the caller's ``kink``
callable says where the argument of an ``Abs`` is exactly 0), where the element is masked (its
logit never reaches the softmax), or where its log-prior is -inf (the prior hides the key: its
weight is 0 and so is the limit of its term, as for Laplace's ``|d| / b**2`` at a position of
-inf).  Any other NaN is kept, so that a prior whose derivative is
genuinely undefined shows up as NaN instead of being hidden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch

Tensor = torch.Tensor
ParamValue = Union[float, int, Tensor]

# log_prior(d, p) -> tensor broadcastable to [B, Hq, Nq, Nk]
#   d: [B, 1, Nq, Nk] distances i_abs - j_abs (floating point, exact integers)
#   p: {name: tensor [B, Hq, Nq, Nk]} (a per-element copy of the per-head value)
LOG2E = 1.4426950408889634   # the kernels' z = logit * log2(e)
LogPrior = Callable[[Tensor, Mapping[str, Tensor]], Tensor]
# score(s, lp, n, p) -> logits; s [B, Hq, Nq, Nk], lp [B, Hq, Nq, Nk] (or broadcastable), n [B, 1, Nq, 1]
Score = Callable[[Tensor, Tensor, Tensor, Mapping[str, Tensor]], Tensor]
# kink(d, p) -> bool tensor broadcastable to [B, Hq, Nq, Nk]: where the argument of an Abs is 0.
#   d: [B, 1, Nq, Nk]; p: {name: float64 tensor [1, Hq, 1, 1]}
Kink = Callable[[Tensor, Mapping[str, Tensor]], Tensor]


def default_score(s: Tensor, lp: Tensor, n: Tensor, p: Mapping[str, Tensor]) -> Tensor:
    return s + lp


def ssmax_score(s: Tensor, lp: Tensor, n: Tensor, p: Mapping[str, Tensor]) -> Tensor:
    """BAM-SSMax: (s + log_prior) * ssmax * log(n)."""
    return (s + lp) * p["ssmax"] * torch.log(n.to(s.dtype))


# Scores that see log_prior only through s + log_prior times a per-row factor: a constant added
# to a row's log-prior moves its logits by a constant, which the softmax ignores.
ROW_SHIFTABLE = (default_score, ssmax_score)


@dataclass
class RefResult:
    """Output and gradients of one reference evaluation.

    ``dparams`` holds one ``[Hq]`` tensor per parameter (float64 for ``ref``, float32 for ``pt``),
    whether or not the caller passed the parameter as a tensor.
    """

    out: Tensor
    dq: Optional[Tensor] = None
    dk: Optional[Tensor] = None
    dv: Optional[Tensor] = None
    dparams: dict = field(default_factory=dict)
    dpos_q: Optional[Tensor] = None   # with positions=: the gradients of pos_q and pos_k
    dpos_k: Optional[Tensor] = None
    visible: Optional[Tensor] = None  # [B, Nq, Nk] bool
    out_must_be_nonfinite: Optional[Tensor] = None  # [B, Hq, Nq, D] bool (see the body)
    empty_rows: Optional[Tensor] = None  # [B, Nq] bool: rows with no visible key
    # ref only (float64, with dout): the gross magnitude of each result, {"out", "dq", "dk", "dv",
    # "d<param>"} -> tensor of the result's shape; see gross_magnitudes() below.
    gross: dict = field(default_factory=dict)


def positions(nq: int, nk: int, q_offset: int, k_offset: int, causal: bool, dtype=torch.float64):
    """One batch row, int offsets: ``d`` [Nq, Nk], ``visible`` [Nq, Nk] and ``n`` [Nq] (see
    ``batch_positions``)."""
    d, _, _, visible, n = batch_positions(1, nq, nk, q_offset, k_offset, causal, dtype=dtype)
    return d[0], visible[0], n[0]


def batch_positions(bsz: int, nq: int, nk: int, q_offset=0, k_offset=0, causal: bool = True,
              key_mask: Optional[Tensor] = None, cu_seqlens_q=None, cu_seqlens_k=None,
              dtype=torch.float64):
    """Positions and visibility of every (batch row, query, key), computed plainly in int64.

    Offsets are ints or per-batch-row sequences [B]. With ``cu_seqlens_q``/``cu_seqlens_k``
    (packed documents, B == 1) positions restart at 0 in each document and a query sees only its
    own document's keys. ``key_mask`` [B, Nk] (False: padding) hides keys.
    Returns ``d`` [B, Nq, Nk] (i_abs - j_abs, in ``dtype``), ``i_abs`` [B, Nq], ``j_abs`` [B, Nk]
    (``dtype``), ``visible`` [B, Nq, Nk] (bool) and ``n`` [B, Nq] (int64, visible keys per row)."""
    qo = torch.as_tensor(q_offset, dtype=torch.int64).reshape(-1).expand(bsz)[:, None]
    ko = torch.as_tensor(k_offset, dtype=torch.int64).reshape(-1).expand(bsz)[:, None]
    i_abs = torch.arange(nq, dtype=torch.int64)[None] + qo
    j_abs = torch.arange(nk, dtype=torch.int64)[None] + ko
    same_doc = torch.ones(bsz, nq, nk, dtype=torch.bool)
    if cu_seqlens_q is not None:
        cq = [int(x) for x in cu_seqlens_q]
        ck = [int(x) for x in cu_seqlens_k]
        doc_q = torch.zeros(nq, dtype=torch.int64)
        doc_k = torch.zeros(nk, dtype=torch.int64)
        for doc in range(len(cq) - 1):
            doc_q[cq[doc]:cq[doc + 1]] = doc
            doc_k[ck[doc]:ck[doc + 1]] = doc
            i_abs[:, cq[doc]:cq[doc + 1]] -= cq[doc]
            j_abs[:, ck[doc]:ck[doc + 1]] -= ck[doc]
        same_doc = (doc_q[:, None] == doc_k[None, :])[None].expand(bsz, nq, nk)
    d_int = i_abs[:, :, None] - j_abs[:, None, :]
    visible = same_doc & (d_int >= 0) if causal else same_doc.clone()
    if key_mask is not None:
        visible = visible & torch.as_tensor(key_mask, dtype=torch.bool)[:, None, :]
    return d_int.to(dtype), i_abs.to(dtype), j_abs.to(dtype), visible, visible.sum(-1)


def _per_head(value: ParamValue, hq: int) -> Tensor:
    """A parameter as a float64 ``[Hq]`` tensor (detached); a vector parameter, given 2-D as
    ``[Hq, K]`` (or ``[1, K]``: the same for every head), as ``[Hq, K]``."""
    t = torch.as_tensor(value.detach() if isinstance(value, Tensor) else value, dtype=torch.float64)
    if t.dim() == 2:
        if t.shape[0] not in (1, hq):
            raise ValueError(f"vector parameter has {t.shape[0]} rows, expected 1 or {hq}")
        return t.expand(hq, t.shape[1]).clone()
    t = t.reshape(-1)
    if t.numel() == 1:
        t = t.expand(hq)
    if t.numel() != hq:
        raise ValueError(f"parameter has {t.numel()} values, expected 1 or {hq}")
    return t.clone()


def _float32_range(lp: Tensor, visible: Tensor) -> Tensor:
    """The log-prior as the kernels can hold it: they shift it per head by its largest value
    over the call's visible scores and hold the result in float32, where a value more than
    float32's largest (3.4e38) below that peak is -inf, and a key whose log-prior is -inf is
    hidden (docs/reliability.md, "float32's range"). Without this rule a row whose every key
    lies 1e39 nats below its head's best distance (GGD with beta = 300 far from mu) is alive
    here and sees no key in the kernels."""
    if visible.numel() == 0:   # no batch row, query or key: nothing to measure from
        return lp
    return torch.where(lp - _head_peak(lp, visible) < -torch.finfo(torch.float32).max, float("-inf"), lp)


def _head_peak(lp: Tensor, visible: Tensor) -> Tensor:
    """Per head, the largest finite log-prior over the call's visible scores (0 where none is),
    detached: what the kernels' distance table measures the prior from."""
    seen = visible & torch.isfinite(lp)
    peak = torch.where(seen, lp, float("-inf")).amax(dim=(0, 2, 3), keepdim=True).detach()
    return torch.where(torch.isfinite(peak), peak, 0.0)


def _float32_logit_range(s: Tensor, lp: Tensor, n: Tensor, leaves: Mapping[str, Tensor], score,
                          visible: Tensor) -> Tensor:
    """For a score that scales s + log_prior (SSMax: times ssmax * log n), the log-prior with
    -inf where the kernels' float32 logit is -inf. Both backends compute such a score's
    z = logit * log2(e) in float32 from s + (log_prior minus its head's peak over the call), and
    a z below -3.4e38 is -inf there. A row far from its head's best distance then sees no key,
    where exact arithmetic would give it the softmax of its own keys (found by the runtime fuzz:
    BAM-SSMax, ssmax = 1e30, queries at 2**23, rows 5 positions from the head's best one;
    docs/reliability.md, "float32's range"). A per-row reference in the kernels would lift it."""
    if visible.numel() == 0:
        return lp
    with torch.no_grad():
        z = score(s.detach(), lp.detach() - _head_peak(lp, visible), n, {k: t.detach() for k, t in leaves.items()}) * LOG2E
    return torch.where(z < -torch.finfo(torch.float32).max, float("-inf"), lp)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: Mapping[str, ParamValue],
    log_prior: Optional[LogPrior],
    *,
    causal: bool,
    scale: Optional[float] = None,
    q_offset=0,
    k_offset=0,
    key_mask: Optional[Tensor] = None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    score: Optional[Score] = None,
    kink: Optional[Kink] = None,
    dout: Optional[Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
    clamp_positions: bool = False,
    positions: Optional[tuple] = None,
) -> RefResult:
    """Naive attention with a positional prior; with ``dout`` also all gradients.

    ``compute_dtype=torch.float64`` gives ``ref``; the test dtype gives ``pt`` (see module doc).
    ``log_prior=None`` means the zero prior. Offsets, ``key_mask`` and ``cu_seqlens_*``: see
    ``batch_positions``; ``n`` counts the keys a query really sees (after all of them).
    ``clamp_positions``: the prior sees a padding token's negative position as 0, and d from
    the positions so read (the runtime's rule for a prior in i or j); the masks do not.
    ``positions``: (pos_q [B, Hq, Nq], pos_k [B, Hq, Nk]) float position tensors (one channel,
    per head; docs/positions.md): the prior reads i, j and d = i - j from them, the masks
    still follow token order; with ``dout`` their gradients are ``dpos_q``, ``dpos_k``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, N, D]")
    bsz, hq, nq, dim = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if hq % hk != 0:
        raise ValueError("Hq must be a multiple of Hk")
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    score = score or default_score
    is_ref = compute_dtype == torch.float64
    # Parameters and the prior: float64 for ref, float32 for pt (FlashAttention's fp32 bias).
    prior_dtype = torch.float64 if is_ref else torch.float32

    qc = q.detach().to(compute_dtype).requires_grad_(dout is not None)
    kc = k.detach().to(compute_dtype).requires_grad_(dout is not None)
    vc = v.detach().to(compute_dtype).requires_grad_(dout is not None)

    d, i_pos, j_pos, visible, n_int = batch_positions(bsz, nq, nk, q_offset, k_offset, causal, key_mask,
                                                       cu_seqlens_q, cu_seqlens_k, dtype=prior_dtype)
    empty = n_int == 0                                            # [B, Nq]
    visible4 = visible[:, None]                                   # [B, 1, Nq, Nk]

    heads64 = {name: _per_head(val, hq) for name, val in params.items()}
    # one leaf per (batch row, head, query, key): a gradient per logit element, cleaned by the
    # kink convention element by element before it is summed
    # (a vector's leaf has its elements last: [B, Hq, Nq, Nk, K])
    leaves = {
        name: t.to(prior_dtype).reshape(1, hq, 1, 1, *t.shape[1:])
        .expand(bsz, hq, nq, nk, *t.shape[1:]).clone().requires_grad_(dout is not None)
        for name, t in heads64.items()
    }

    group = hq // hk
    kx = kc.repeat_interleave(group, dim=1)
    vx = vc.repeat_interleave(group, dim=1)

    s = torch.matmul(qc, kx.transpose(-1, -2)) * scale  # [B, Hq, Nq, Nk], compute dtype
    if log_prior is None:
        lp = torch.zeros(1, 1, nq, nk, dtype=prior_dtype)
    else:
        # A prior may use the absolute positions too: p["i"] [B, 1, Nq, 1] and p["j"] [B, 1, 1, Nk]
        # (i and j are reserved names, never parameters).
        d_seen, i_seen, j_seen = d, i_pos, j_pos
        if clamp_positions:
            i_seen, j_seen = i_pos.clamp_min(0), j_pos.clamp_min(0)
            d_seen = i_seen[:, :, None] - j_seen[:, None, :]
        if positions is not None:
            pos_leaves = [t.detach().to(prior_dtype).requires_grad_(dout is not None)
                          for t in positions]
            i4, j4 = pos_leaves[0][..., :, None], pos_leaves[1][..., None, :]
            lp = log_prior(i4 - j4, {**leaves, "i": i4, "j": j4})
        else:
            lp = log_prior(d_seen[:, None], {**leaves, "i": i_seen[:, None, :, None],
                                             "j": j_seen[:, None, None, :]})
        if is_ref:
            lp = _float32_range(lp, visible[:, None])
            if score is not default_score and score in ROW_SHIFTABLE:
                n_seen = n_int.clamp(min=1).to(prior_dtype)[:, None, :, None]
                lp = _float32_logit_range(s, lp, n_seen, leaves, score, visible[:, None])
        if score in ROW_SHIFTABLE and nk > 0:
            # a softmax ignores a constant per row, so measure the prior from its largest visible
            # value in the row (detached: its gradient meets sum_j dS = 0). Exact in real
            # arithmetic; without it a prior that is huge and flat over the row (GGD with
            # mu = 1e30: -9e22 at every key) swallows s even in float64, and the "reference"
            # would give uniform weights where the answer is NoPE's.
            peak = torch.where(visible[:, None] & torch.isfinite(lp), lp, float("-inf")).amax(-1, keepdim=True)
            lp = lp - torch.where(torch.isfinite(peak), peak, 0.0).detach()
    # n as seen by the score; rows with n == 0 are fully masked and their value is irrelevant, so
    # they get n = 1 to keep e.g. log(n) finite (and its gradient, 0 * log 0, out of the picture).
    n = n_int.clamp(min=1).to(prior_dtype)[:, None, :, None]
    logit_raw = score(s, lp, n, leaves)  # pt: promoted to float32 by the float32 prior
    if score is not default_score:
        # a log-prior of -inf hides its key whatever the score makes of it (block skipping drops
        # such keys unseen): SSMax's (s - inf) * log(n) would be NaN for a row with one key
        logit_raw = torch.where(lp == float("-inf"), float("-inf"), logit_raw)
    if logit_raw.dim() < 4:
        logit_raw = logit_raw.expand(bsz, hq, nq, nk)
    logit = logit_raw

    # A row none of whose visible keys has a logit above -inf (no visible key, every one outside
    # a prior's window, or -inf data) gives 0 and zero gradients, like a row that sees no key.
    logit = torch.where(visible4, logit, float("-inf"))
    dead = (logit == float("-inf")).all(-1, keepdim=True)          # [B, Hq, Nq, 1]
    p = torch.softmax(torch.where(dead, 0.0, logit), dim=-1) * (~dead).to(logit.dtype)
    out = torch.matmul(p.to(vx.dtype), vx)

    res = RefResult(out=out.detach(), visible=visible, empty_rows=empty)
    # Where an input is NaN or infinite: the rows that must be non-finite are those that give it
    # weight (a key with weight exactly 0 contributes nothing, whatever its v); `out` above,
    # like SDPA's P @ V, also spreads a non-finite v to rows that give it weight 0.
    pv = p.detach().to(vx.dtype)[..., None] * vx.detach()[:, :, None]      # [B, Hq, Nq, Nk, D]
    res.out_must_be_nonfinite = (~torch.isfinite(torch.where((p.detach() > 0)[..., None], pv, 0.0).sum(-2))
                                 | torch.isnan(p.detach()).any(-1, keepdim=True))
    if dout is None:
        return res

    kink_mask = torch.zeros(bsz, hq, nq, nk, dtype=torch.bool)
    if kink is not None:
        p64 = {name: t.reshape(1, hq, 1, 1) for name, t in heads64.items()}
        d_kink = d.double()[:, None] if positions is None else \
            (positions[0].double()[..., :, None] - positions[1].double()[..., None, :])
        kink_mask = kink_mask | torch.as_tensor(kink(d_kink, p64), dtype=torch.bool)
    # (and where the prior hides the key: P is 0 there, so an infinite derivative, Laplace's
    # |d| / b**2 at a key at position -inf, adds nothing: docs/positions.md)
    excused = kink_mask | ~visible4
    if log_prior is not None:
        excused = excused | (lp.detach() == float("-inf"))

    def clean(g, leaf):  # the kink convention: NaN -> 0 only at kinks and masked elements
        if g is None:
            return torch.zeros_like(leaf)
        return torch.where(_fit(excused, g) & torch.isnan(g), torch.zeros_like(g), g)

    dout_c = dout.detach().to(out.dtype)
    if is_ref:
        # |d logit / d s| per element (1 for s + log_prior; SSMax's ssmax * log n scales dS
        # before it reaches dq and dk)
        dlds = torch.autograd.grad(logit_raw, s, torch.ones_like(logit_raw), retain_graph=True,
                                   allow_unused=True)[0] if score is not default_score else None
        dlds_abs = None if dlds is None else torch.where(torch.isfinite(dlds), dlds.abs(), 0.0)
        res.gross = gross_magnitudes(p.detach(), qc.detach(), kx.detach(), vx.detach(), dout_c, scale,
                                     group, dlds_abs)
        if leaves:
            # sum_b dS_abs * dlogit/dtheta per element (dlogit/dtheta does not depend on b for a
            # log-prior; for a score that mixes s in, this is a lower bound, fine for a floor)
            ds_abs = res.gross.pop("_ds_abs")
            gg = torch.autograd.grad(logit_raw, list(leaves.values()), grad_outputs=ds_abs,
                                     retain_graph=True, allow_unused=True)
            for (name, leaf), g in zip(leaves.items(), gg):
                res.gross["d" + name] = torch.where(_fit(visible4, leaf), clean(g, leaf).abs(),
                                                    0.0).sum(dim=(0, 2, 3))
        res.gross.pop("_ds_abs", None)

    if is_ref and leaves and score is default_score:
        dlp = torch.autograd.grad(logit_raw, list(leaves.values()), torch.ones_like(logit_raw),
                                  retain_graph=True, allow_unused=True)
        ds = torch.autograd.grad(out, logit_raw, dout_c, retain_graph=True)[0]
    inputs = [qc, kc, vc] + list(leaves.values())
    if positions is not None and log_prior is not None:
        grads = torch.autograd.grad(out, inputs + pos_leaves, grad_outputs=dout_c, allow_unused=True)
        res.dpos_q, res.dpos_k = (torch.zeros_like(x) if g is None else g
                                  for g, x in zip(grads[-2:], pos_leaves))
        grads = grads[:-2]
    else:
        grads = torch.autograd.grad(out, inputs, grad_outputs=dout_c, allow_unused=True)
    res.dq, res.dk, res.dv = (g if g is not None else torch.zeros_like(x) for g, x in zip(grads[:3], inputs[:3]))
    for (name, leaf), g in zip(leaves.items(), grads[3:]):
        res.dparams[name] = clean(g, leaf).sum(dim=(0, 2, 3))
    if is_ref and leaves and score is default_score:
        for (name, leaf), d in zip(leaves.items(), dlp):
            res.dparams[name] = _float32_derivatives(res.dparams[name], ds, d, leaf, clean)
    return res


def _float32_derivatives(dparam: Tensor, ds: Tensor, dlp: Optional[Tensor], leaf: Tensor, clean) -> Tensor:
    """A parameter's gradient as the kernels define it where the log-prior's derivative leaves
    float32's range: sum dS * d log_prior / d theta with that derivative clamped to +-3.4e38
    (the distance tables hold float32; docs/reliability.md, "float32's range"). Next to a kink
    of a prior with beta < 1 (GGD, mu = 4e-44, beta = 0.05: |d - mu| ** (beta - 1) ~ 1e40) the
    exact gradient may lie beyond float32's range, which no float32 result can hold. Unchanged
    where every finite derivative is within range; an infinite or NaN derivative (a formula
    that breaks at a parameter value, not a float32 limit) stays as it is, for the tests to see."""
    big = torch.finfo(torch.float32).max
    if dlp is None or not bool((torch.isfinite(dlp) & (dlp.abs() > big)).any()):
        return dparam
    clamped = torch.where(torch.isfinite(dlp), dlp.clamp(-big, big), dlp)
    ds = _fit(ds, clamped)
    return clean(torch.where(ds != 0, ds * clamped, 0.0), leaf).sum(dim=(0, 2, 3))


def _fit(t: Tensor, like: Tensor) -> Tensor:
    """``t`` with trailing dimensions of size 1 to broadcast against ``like`` (a vector
    parameter's gradients have its elements last)."""
    return t.reshape(*t.shape, *([1] * (like.dim() - t.dim())))


def gross_magnitudes(p, q, kx, vx, dout, scale, group, dlds_abs=None):
    """The size of the terms that each result is a (possibly cancelling) sum of.

    The backward is dS = P * (dP - rowsum(P * dP)), dP = dO v^T; a result such as a parameter
    gradient, sum_ij dS_ij dlogit_ij/dtheta, can cancel to (nearly) 0 although its terms are
    large — with a single key dS is exactly 0.  Any implementation then carries a rounding error
    proportional to the terms, not to the result.  This returns, per result element, the same
    expressions with every product and sum replaced by its absolute-value counterpart:
    A = |dO| |v|^T (bounds |dP|), dS_abs = P * (A + rowsum(P * A)), and
    out: P |v|, dv: P^T |dO|, dq: scale dS_abs |k|, dk: scale dS_abs^T |q|; the caller adds
    the parameters (dS_abs against |dlogit/dtheta|).  For a score other than s + log_prior,
    dq and dk see dS_abs times |d logit / d s| (``dlds_abs``).  All in float64.
    """
    bsz, hq, nq, dim = q.shape
    hk = hq // group
    nk = kx.shape[2]
    a = torch.matmul(dout.abs(), vx.abs().transpose(-1, -2))
    ds_abs = p * (a + (p * a).sum(-1, keepdim=True))
    g_out = torch.matmul(p, vx.abs())
    chained = ds_abs if dlds_abs is None else ds_abs * dlds_abs   # dS through d logit / d s
    g_dq = scale * torch.matmul(chained, kx.abs())
    g_dk = scale * torch.matmul(chained.transpose(-1, -2), q.abs()).reshape(bsz, hk, group, nk, dim).sum(2)
    g_dv = torch.matmul(p.transpose(-1, -2), dout.abs()).reshape(bsz, hk, group, nk, dim).sum(2)
    return {"out": g_out, "dq": g_dq, "dk": g_dk, "dv": g_dv, "_ds_abs": ds_abs}
