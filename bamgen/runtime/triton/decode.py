"""The decode kernels (flash-decoding), written once for every prior (hooks.py):
_attn_decode (one program per (key split, batch, query head): the forward's online softmax over
the split's keys, for all of the call's 1-16 query rows at once) and _decode_combine (one
program per (row, batch, query head): the splits' partial results merged by log-sum-exp).

Why: with a KV cache a generation step has one query row (a few with speculative decoding)
against thousands of keys. The prefill kernel gives that to B * Hq programs, each walking every
key alone: on a GPU with 132 SMs and 8 heads, 124 SMs idle. Splitting the keys over
programs fills the GPU; the partial (acc, m, l) of each split merge exactly, since
exp2(z - m) rescales to any common m.

Constexpr flags (as in forward.py unless said):
  NUM_PARAMS, CAUSAL, BLOCK_N, HEAD_DIM, D, DOT_PREC, UPCAST_DOT, HAS_KEY_MASK, ROW_OFFSETS,
  TABLE_GATHER (at head dim 128 the 16x128 tile's table pointers have Q's shape, as the
               forward's do at 64: tiles.FWD_TABLE_GATHER)
  BLOCK_M      query rows per program: every row of the call (Nq <= BLOCK_M), padded to 16,
               the smallest M of a tensor-core MMA
  BLOCK_S      (combine) the number of splits padded to a power of two
Runtime: as the forward, plus keys_per_split (a multiple of BLOCK_N, so that the splits cut
along key tiles and the steady state stays whole) and num_splits. Packed documents (VARLEN)
are not taken here: the host sends them to the prefill kernel.
The partials (PartO: the unnormalised acc, PartM / PartL: the running max and sum in base 2)
are float32 [num_splits, B * Hq, Nq, (HEAD_DIM)]; a split with no visible key leaves
m = -inf and l = 0, which the merge weighs 0.
"""
import triton
import triton.language as tl

from .forward import _attn_fwd_inner
from .helpers import (
    TABLE_ROW_ARGS, _fp32_scalars, _ramp_nearest_key, _ramp_nearest_row_term, _ramp_reference, _ramp_row_term,
    _kv_bases, _lowp, _row_offsets, _steady_keys, _window_keys)
from .hooks import RAMP, RAMP_SYMMETRIC, SKIP, prior_ramp, prior_scalars  # noqa: F401 (variant.py)


@triton.jit(do_not_specialize=TABLE_ROW_ARGS)
def _attn_decode(Q, K, V, Theta, PartO, PartM, PartL, Table, Window, NRow, KeyMask, QOff, KOff,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn,
                 Hq, GROUP, Nq, Nk, q_offset, k_offset, sm_scale, d_top_b, tab_slot, tab_stride_h,
                 stride_nb, stride_mb, row_abs, keys_per_split,
                 NUM_PARAMS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
                 DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 HAS_KEY_MASK: tl.constexpr, ROW_OFFSETS: tl.constexpr, TABLE_GATHER: tl.constexpr,
                 KV_TMA: tl.constexpr):
    """One program: the keys of one split for every query row of one (batch, head). Writes
    the split's unnormalised output and its row statistics (base 2) to the partials. KV_TMA:
    K and V are tensor descriptors, as the forward's (forward.py; launch.kv_tma)."""
    sm_scale, row_abs = _fp32_scalars(sm_scale, row_abs)   # (fp64 under inductor)
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    num_bh = tl.num_programs(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    off_hk = off_h // GROUP
    q_offset, k_offset = _row_offsets(QOff, KOff, off_b, q_offset, k_offset, ROW_OFFSETS)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    d_ok = offs_d < D
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    # (a descriptor reads no key mask's zeros: launch.kv_tma)
    tl.static_assert(not (KV_TMA and HAS_KEY_MASK))
    k_base, v_base, kv_row = _kv_bases(K, V, off_b, off_hk, 0, stride_kb, stride_kh, stride_kn,
                                       stride_vb, stride_vh, stride_vn, Hq, GROUP, KV_TMA)
    km_base = KeyMask + off_b.to(tl.int64) * stride_mb
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # the prior's parameters for this head, and what depends on them alone
    sc = prior_scalars(Theta + off_h * NUM_PARAMS)
    offs_m_abs = offs_m + q_offset
    n_visible = tl.load(NRow + off_b.to(tl.int64) * stride_nb + offs_m, mask=row_ok, other=0.0)
    # the keys any row sees, [n_lo, n_hi), and those every row sees whole, [n_lo, n_full)
    n_lo = 0
    n_hi = Nk
    if CAUSAL:
        n_hi = tl.minimum(Nk, tl.maximum(Nq + q_offset - k_offset, 0))
    if SKIP:
        # block skipping: keys outside this head's window of distances [lo, hi] are skipped
        n_lo, n_hi = _window_keys(Window, off_h, q_offset - k_offset, BLOCK_M, n_hi, BLOCK_N)
    n_full = _steady_keys(0, Nq, Nk, q_offset, k_offset, n_lo, n_hi, CAUSAL, SKIP, BLOCK_M,
                          BLOCK_N, WHOLE_ROWS=False)
    # this split's keys: [s_lo, s_hi), cut along key tiles
    s_lo = tl.maximum(pid_s * keys_per_split, n_lo)
    s_hi = tl.minimum(pid_s * keys_per_split + keys_per_split, n_hi)
    s_full = tl.maximum(s_lo, tl.minimum(s_hi, n_full))
    # d_top_b - 33554433 is d_top, unknowable to the compiler (TABLE_ROW_ARGS)
    tab_rows = Table + off_h.to(tl.int64) * tab_stride_h + (d_top_b - 33554433 - offs_m_abs)[:, None]
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e)
    if RAMP:
        # the prior is a line in d on the causal side (see forward.py); every split measures
        # a row's scores from the same reference key, its own, so that their m compare
        ramp = prior_ramp(sc)
        ramp_slope = ramp[0]
        ramp_ref = _ramp_reference(offs_m_abs, Nk - 1 + k_offset, k_offset, ramp_slope)
        ramp_ref_f = ramp_ref.to(tl.float32)
    else:
        ramp_slope = 0.0
        ramp_ref = 0
        ramp_ref_f = 0.0
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m_abs, n_visible, row_ok, offs_d, s_lo, s_full, Nk,
                                    k_offset, qk_scale, sm_scale, tab_rows, ramp_slope,
                                    ramp_ref_f, km_base, sc, 0.0, Theta, 0, CAUSAL, True, BLOCK_N,
                                    D, HEAD_DIM, DOT_PREC, UPCAST_DOT, HAS_KEY_MASK,
                                    TABLE_GATHER, kv_row, KV_TMA)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m_abs, n_visible, row_ok, offs_d, s_full, s_hi, Nk,
                                    k_offset, qk_scale, sm_scale, tab_rows, ramp_slope,
                                    ramp_ref_f, km_base, sc, 0.0, Theta, 0, CAUSAL, False, BLOCK_N,
                                    D, HEAD_DIM, DOT_PREC, UPCAST_DOT, HAS_KEY_MASK,
                                    TABLE_GATHER, kv_row, KV_TMA)
    if RAMP:
        if CAUSAL:   # m measured from each row's own reference, as the forward's statistics are
            m_i += _ramp_row_term(offs_m_abs, ramp_ref, ramp_slope, ramp[1], row_abs)
        elif RAMP_SYMMETRIC:   # measured from each row's nearest key, as the forward's statistics are
            near = _ramp_nearest_key(offs_m_abs, Nk - 1 + k_offset, k_offset)
            m_i += _ramp_nearest_row_term(offs_m_abs, near, ramp_slope, ramp[1], row_abs)
    rows = (pid_s * num_bh + pid_bh).to(tl.int64) * Nq + offs_m
    tl.store(PartO + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
    tl.store(PartM + rows, m_i, mask=row_ok)
    tl.store(PartL + rows, l_i, mask=row_ok)

@triton.jit
def _decode_combine(PartO, PartM, PartL, O, Mrow, Lrow, stride_ob, stride_oh, stride_om,
                    Hq, Nq, num_splits,
                    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr):
    """One program: one query row of one (batch, head). Merges the splits' partials:
    m = max m_s, l = sum l_s 2^(m_s - m), O = sum acc_s 2^(m_s - m) / l; a row that saw no
    key (every l_s 0) gets O = 0, m = -inf, l = 0, as from the prefill kernel."""
    row = tl.program_id(0)
    pid_bh = tl.program_id(1)
    num_bh = tl.num_programs(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    parts = (offs_s * num_bh + pid_bh).to(tl.int64) * Nq + row
    m_s = tl.load(PartM + parts, mask=split_ok, other=-float("inf"))
    l_s = tl.load(PartL + parts, mask=split_ok, other=0.0)
    m = tl.max(m_s, 0)
    weight = tl.exp2(m_s - tl.where(m == -float("inf"), 0.0, m))   # 0 for an empty split
    l = tl.sum(l_s * weight, 0)
    acc = tl.load(PartO + parts[:, None] * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None],
                  other=0.0)
    out = tl.where(l == 0.0, 0.0, tl.sum(acc * weight[:, None], 0) / tl.where(l == 0.0, 1.0, l))
    tl.store(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + row * stride_om
             + offs_d, _lowp(out, O.dtype.element_ty), mask=offs_d < D)
    tl.store(Mrow + pid_bh.to(tl.int64) * Nq + row, m)
    tl.store(Lrow + pid_bh.to(tl.int64) * Nq + row, l)
