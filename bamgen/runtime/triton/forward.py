"""The forward kernel (FlashAttention-2 style online softmax in base 2), written once for every
prior; the prior enters through the hooks and flags of hooks.py (variant.py instantiates it).

Constexpr flags of the launch:
  NUM_PARAMS   columns of the [Hq, NUM_PARAMS] float32 parameter tensor Theta (0: no params)
  CAUSAL       key j is visible to query i iff j + k_offset <= i + q_offset
  BLOCK_M      query rows per tile;  BLOCK_N  keys per tile
  HEAD_DIM     head dimension padded to a power of two >= 16;  D  the real head dimension
  DOT_PREC, UPCAST_DOT  see helpers.py
  STORE_O32    the forward also writes O in float32 (training in fp16/bf16): the backward's
               rowsum(dO * O) from the rounded O skews every parameter gradient
  STEADY       (_attn_fwd_inner) the key tiles are seen whole by every row: no causal or
               bounds masks
  HAS_KEY_MASK key_mask [B, Nk] (KeyMask, bytes, 0 = a padding key): every key tile, the
               steady state's included, hides its padding keys (one byte load per key and a
               where() per score) and reads them as 0; off, KeyMask is a placeholder never read
  ROW_OFFSETS  q_offset / k_offset are int32 tensors [B] (QOff, KOff), read once per program
               for its batch row, so the steady state's bounds are the row's; off, the scalar
               arguments q_offset / k_offset hold them and the pointers are placeholders
  VARLEN       packed documents (B = 1): program_id(0) indexes Work, the host's list of
               (document, query tile) items, and the program's rows and keys are its
               document's (CuSeqQ / CuSeqK: int32 cumulative lengths), positions local and
               offsets 0; key tiles of other documents are never visited
  TABLE_GATHER "async", "coalesced", "direct" or "prefetch": how a table prior's tile of
               entries is read (tiles.fwd_table_gather; helpers._gather_table; "prefetch" is
               "direct" one tile ahead: _attn_fwd_inner); ignored without a table
  KV_TMA       K and V are tensor descriptors (launch.kv_descriptors: [B * Hk, Nk, D], a block
               of [1, BLOCK_N, HEAD_DIM]) and each key tile is one TMA copy of each, which
               reads zeros past Nk and D (what the pointer loads' masks give); off, pointers.
               Only where the three flags above are off (launch.kv_tma), and pinned
               (pinned(kv="tma"): tiles.KV_TMA_SHIPPED names no kernel; FWD_TMA_AT's tile)
With the three layout flags off the kernel compiles to what it was without them (the same loops).
The prior's flags (TABLE, RAMP, ROW_FACTORS, SKIP, ...) are hooks.py's.
Runtime (never recompiles): Nq, Nk, q_offset, k_offset, sm_scale, strides, Hq, GROUP, the
key_mask's row stride stride_mb, the per-row key counts NRow (n) and the table strategy's Table,
d_top_b (d_top + TABLE_ROW_BIAS, 33554433: helpers.TABLE_ROW_ARGS), tab_slot, tab_stride_h (see
launch.py); the inline strategy passes the table arguments and ignores them. row_abs (1.0 or
0.0): whether Mrow holds the absolute row max (forward_block, whose blocks are merged) or, where
a causal ramp measures scores from a reference key (see helpers._ramp_reference), the max
relative to the row's reference: a softmax is blind to a row's constant, and left out it cannot
round the scores that matter.
"""
import triton
import triton.language as tl

from .helpers import (
    TABLE_ROW_ARGS, _as_cols, _as_rows, _distance, _dot, _factored_logit2, _fp32_scalars, _kept_keys,
    _load_kept,
    _gather_table, _kv_bases, _load_kv, _logit2, _lowp, _logit_row2, _position, _position_diff, _program_span, _ramp_logit2,
    _ramp_nearest_key, _ramp_nearest_row_term, _ramp_reference, _ramp_row_term, _row_offsets,
    _steady_keys, _table_load, _table_logit2, _tensor_positions, _value_entries, _window_keys)
from .hooks import (  # noqa: F401 (each prior's kernels get its own: variant.py)
    POSITIONS, RAMP, RAMP_SYMMETRIC, ROW_FACTORS, SCALED_SCORE, SKIP, TABLE, TABLE_POSITIONS,
    prior_ramp, prior_scalars)


@triton.jit
def _fwd_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_at, sc,
                TABLE_GATHER: tl.constexpr):
    """_logit2, with a table prior's entries read as TABLE_GATHER says."""
    if TABLE:
        return _table_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n,
                             _gather_table(tab_at, TABLE_GATHER), sc)
    else:
        return _logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_at, sc)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                    offs_m_abs, n_visible, row_ok, offs_d, n_lo, n_hi, Nk, k_offset, qk_scale,
                    sm_scale, tab_rows, ramp_slope, ramp_ref, km_base, sc, pos_rows, PosK, pk_head,
                    CAUSAL: tl.constexpr, STEADY: tl.constexpr, BLOCK_N: tl.constexpr,
                    D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST_DOT: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                    TABLE_GATHER: tl.constexpr, kv_row=0, KV_TMA: tl.constexpr = False):
    """Online softmax over the key tiles [n_lo, n_hi) of one query tile (base-2 exponent).

    STEADY: every key of these tiles exists and is visible to every row of the tile (the
    causal part strictly left of the diagonal tile), so nothing is masked. Where the prior
    is a line in d on the causal side (RAMP), a causal logit is s + slope * (ref - j)
    (log2 units): ramp_ref holds each row's reference key (float32), and the difference is
    exact, instead of a per-score evaluation of the prior. POSITIONS: the rows' positions are
    pos_rows, the keys' read from PosK (this head's first key at pk_head). KV_TMA: k_base and v_base are the
    descriptors, and this (batch, kv head) is their row kv_row."""
    if POSITIONS > 0:
        pos_i = pos_rows
    else:
        pos_i = _position(offs_m_abs)[:, None]
    pos_n = n_visible[:, None]
    if RAMP_SYMMETRIC:
        near_ref = _ramp_nearest_key(offs_m_abs, Nk - 1 + k_offset, k_offset)[:, None]
    if ROW_FACTORS:
        logit_r2 = _logit_row2(pos_i, pos_n, sc)   # the logit's row factor, once (ROW_FACTORS)
    # "prefetch": each tile's table entries are read one tile ahead, in registers (the first
    # before the loop, the next at each tile's top), so a load has a whole tile's work to
    # arrive under. Read in the tile that uses them, ptxas issued them after the score MMA's
    # wait and the next instruction waited for each (docs/performance.md, "Latency and
    # occupancy, tested"). The next tile is clamped to the last one the loop visits, so every
    # read in the loop is of entries the loop reads anyway; an empty loop's one read (its first
    # tile, at most a tile past the last key) falls inside the table's TABLE_PAD entries.
    # (Positions from tensors: the keys' positions come with their tile, so those read directly.)
    PREFETCH: tl.constexpr = TABLE and TABLE_GATHER == "prefetch" and not TABLE_POSITIONS
    # SCALED_SCORE (NoPE): z holds q.k, the max is taken on it and scaled once per row, and P is
    # one FFMA a score (see helpers.py, "P of a scaled score")
    if PREFETCH:
        last_n = n_lo + tl.maximum(n_hi - n_lo - 1, 0) // BLOCK_N * BLOCK_N
        tab_next = _table_load(tab_rows + (n_lo + k_offset + tl.arange(0, BLOCK_N))[None, :])
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_n_abs = offs_n + k_offset
        if PREFETCH:
            tab_tile = tab_next
            ahead = tl.minimum(start_n + BLOCK_N, last_n) + k_offset + tl.arange(0, BLOCK_N)
            tab_next = _table_load(tab_rows + ahead[None, :])
        if KV_TMA:
            k = k_base.load([kv_row, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k = _load_kv(k_base, offs_n, stride_kn, offs_d, Nk, not STEADY, D, HEAD_DIM)
        if HAS_KEY_MASK:   # (a NaN in a padding key's k is hidden by the where() below)
            kept = _kept_keys(km_base, offs_n, Nk)
        qk = _dot(q, tl.trans(k), None, DOT_PREC, UPCAST_DOT)
        if POSITIONS > 0:
            pos_j = _as_cols(_tensor_positions(PosK, pk_head, offs_n, offs_n < Nk))
            pos_d = _position_diff(pos_i, pos_j)
        else:
            pos_j = _position(offs_n_abs)[None, :]
            pos_d = _distance(offs_m_abs[:, None], offs_n_abs[None, :])
        if TABLE_POSITIONS:   # the entries at the keys' integer positions (see _attn_fwd)
            tab_at = tab_rows + pos_j.to(tl.int32)
        else:
            tab_at = tab_rows + offs_n_abs[None, :]
        if SCALED_SCORE:
            z = qk
        elif RAMP:
            if CAUSAL:   # (a hidden score, d < 0, is off the line: the mask below drops it)
                # (ref - j in float32 is exact: positions stay within 2**24, MAX_POSITION)
                ramp_d = ramp_ref[:, None] - offs_n_abs.to(tl.float32)[None, :]
                z = tl.fma(ramp_d, ramp_slope, qk * qk_scale)
            elif RAMP_SYMMETRIC:
                z = _ramp_logit2(qk, qk_scale, ramp_slope, offs_m_abs[:, None], offs_n_abs[None, :],
                                 near_ref)
            else:
                z = _fwd_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_at, sc,
                                TABLE_GATHER)
        elif ROW_FACTORS:
            if PREFETCH:
                tab = _value_entries(tab_tile)
            elif TABLE:
                tab = _value_entries(_gather_table(tab_at, TABLE_GATHER))
            else:
                tab = ()
            z = _factored_logit2(qk, sm_scale, logit_r2, pos_d, pos_i, pos_j, pos_n, tab, sc)[0]
        elif PREFETCH:
            z = _table_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_tile, sc)
        else:
            z = _fwd_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_at, sc,
                            TABLE_GATHER)
        if not STEADY:
            visible = (offs_n < Nk)[None, :] & row_ok[:, None]
            if CAUSAL:
                visible = visible & (offs_n_abs[None, :] <= offs_m_abs[:, None])
            z = tl.where(visible, z, -float("inf"))
        if HAS_KEY_MASK:
            z = tl.where(kept[None, :], z, -float("inf"))
        if SCALED_SCORE:
            m_new = tl.maximum(m_i, tl.max(z, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(z, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing visible yet
        if SCALED_SCORE:   # (inline: a call here reorders other priors' SASS)
            p = tl.exp2(tl.fma(z, qk_scale, -m_safe[:, None]))
        else:
            p = tl.exp2(z - m_safe[:, None])
        correction = tl.exp2(m_i - m_safe)
        l_i = l_i * correction + tl.sum(p, 1)
        if HAS_KEY_MASK:   # a padding key's v reads as 0: P is 0 there, and 0 * NaN is NaN
            v = _load_kept(v_base, offs_n, stride_vn, offs_d, kept, D)
        elif KV_TMA:
            v = v_base.load([kv_row, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            v = _load_kv(v_base, offs_n, stride_vn, offs_d, Nk, not STEADY, D, HEAD_DIM)
        acc = _dot(_lowp(p, v.dtype), v, acc * correction[:, None], DOT_PREC, UPCAST_DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=TABLE_ROW_ARGS)
def _attn_fwd(Q, K, V, Theta, O, O32, Mrow, Lrow, Table, Window, NRow, KeyMask, QOff, KOff,
              CuSeqQ, CuSeqK, Work, PosQ, PosK,
              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
              Hq, GROUP, Nq, Nk, q_offset, k_offset, sm_scale, d_top_b, tab_slot, tab_stride_h, stride_nb,
              stride_mb, row_abs,
              NUM_PARAMS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
              DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, STORE_O32: tl.constexpr,
              HAS_KEY_MASK: tl.constexpr, ROW_OFFSETS: tl.constexpr, VARLEN: tl.constexpr,
              TABLE_GATHER: tl.constexpr, KV_TMA: tl.constexpr):
    """One program: one query tile of one (batch, head). Writes O and, per row, the running
    max m (base 2) and sum l of the online softmax: the backward rebuilds P as
    exp2(z - m) / l, exact where a rounded log-sum-exp m + log2(l) would cost eps * |z|."""
    sm_scale, row_abs = _fp32_scalars(sm_scale, row_abs)   # (fp64 under inductor)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    off_hk = off_h // GROUP
    rows_all = Nq   # the row stride of the statistics: every row of the call
    keys_all = Nk
    # this program's query tile, and the rows and keys it lives in (a document's, VARLEN)
    pid_m, q_start, Nq, k_start, Nk = _program_span(Work, CuSeqQ, CuSeqK, tl.program_id(0), Nq,
                                                    Nk, VARLEN)
    q_offset, k_offset = _row_offsets(QOff, KOff, off_b, q_offset, k_offset, ROW_OFFSETS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    # this head's first key (of the program's document) in PosK (POSITIONS)
    pk_head = pid_bh.to(tl.int64) * keys_all + k_start
    if POSITIONS > 0:
        pos_rows = _as_rows(_tensor_positions(PosQ, pid_bh.to(tl.int64) * rows_all + q_start, offs_m,
                                              row_ok))
    else:
        pos_rows = 0.0
    d_ok = offs_d < D
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
    # (a descriptor reads no key mask's zeros and no document's start: launch.kv_tma)
    tl.static_assert(not (KV_TMA and (HAS_KEY_MASK or VARLEN)))
    k_base, v_base, kv_row = _kv_bases(K, V, off_b, off_hk, k_start, stride_kb, stride_kh, stride_kn,
                                       stride_vb, stride_vh, stride_vn, Hq, GROUP, KV_TMA)
    km_base = KeyMask + off_b.to(tl.int64) * stride_mb + k_start
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # the prior's parameters for this head, and what depends on them alone
    sc = prior_scalars(Theta + off_h * NUM_PARAMS)
    offs_m_abs = offs_m + q_offset
    n_hi = Nk
    # n: the keys each row sees (counted on the host: over all blocks of the row's keys)
    n_visible = tl.load(NRow + off_b.to(tl.int64) * stride_nb + q_start + offs_m, mask=row_ok, other=0.0)
    if CAUSAL:
        n_hi = tl.minimum(Nk, tl.maximum(pid_m * BLOCK_M + BLOCK_M + q_offset - k_offset, 0))
    n_lo = 0
    if SKIP:
        # block skipping: keys outside this head's window of distances [lo, hi] are skipped
        n_lo, n_hi = _window_keys(Window, off_h, pid_m * BLOCK_M + q_offset - k_offset, BLOCK_M,
                                  n_hi, BLOCK_N)
    # key tiles [n_lo, n_full) are seen whole by every row (the steady state, no masks; rows
    # past Nq compute what no one stores); [n_full, n_hi) hold the diagonal and the ragged end
    n_full = _steady_keys(pid_m * BLOCK_M, Nq, Nk, q_offset, k_offset, n_lo, n_hi, CAUSAL, SKIP,
                          BLOCK_M, BLOCK_N, WHOLE_ROWS=False)
    # distance d of this head sits at Table + h * tab_stride_h + d_top - d: a query's row of
    # the Toeplitz table, indexed by the key's absolute position, starts here
    # d_top_b - 33554433 is d_top, unknowable to the compiler (TABLE_ROW_ARGS)
    # (TABLE_POSITIONS: a query's row at its integer position, which the host shifted so that
    # every position, and the 0 a masked load reads, has its distances inside the table)
    if TABLE_POSITIONS:
        row_at = pos_rows.to(tl.int32)
    else:
        row_at = offs_m_abs[:, None]
    tab_rows = Table + off_h.to(tl.int64) * tab_stride_h + (d_top_b - 33554433 - row_at)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e)
    if RAMP:
        # the prior is a line in d on the causal side: log2(e) * log_prior = intercept + slope * d
        ramp = prior_ramp(sc)
        ramp_slope = ramp[0]
        # each row's own reference key: one per tile put the rows of a tile up to BLOCK_M
        # slopes from theirs, and a steep ramp's scores lost their low bits to that offset
        ramp_ref = _ramp_reference(offs_m_abs, Nk - 1 + k_offset, k_offset, ramp_slope)
        ramp_ref_f = ramp_ref.to(tl.float32)
    else:
        ramp_slope = 0.0
        ramp_ref = 0
        ramp_ref_f = 0.0
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m_abs, n_visible, row_ok, offs_d, n_lo, n_full, Nk,
                                    k_offset, qk_scale, sm_scale, tab_rows, ramp_slope,
                                    ramp_ref_f, km_base, sc, pos_rows, PosK, pk_head, CAUSAL, True, BLOCK_N,
                                    D, HEAD_DIM, DOT_PREC, UPCAST_DOT, HAS_KEY_MASK,
                                    TABLE_GATHER, kv_row, KV_TMA)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m_abs, n_visible, row_ok, offs_d, n_full, n_hi, Nk,
                                    k_offset, qk_scale, sm_scale, tab_rows, ramp_slope,
                                    ramp_ref_f, km_base, sc, pos_rows, PosK, pk_head, CAUSAL, False, BLOCK_N,
                                    D, HEAD_DIM, DOT_PREC, UPCAST_DOT, HAS_KEY_MASK,
                                    TABLE_GATHER, kv_row, KV_TMA)
    if RAMP:
        if CAUSAL:   # m measured from each row's own reference (what the backward rebuilds)
            m_i += _ramp_row_term(offs_m_abs, ramp_ref, ramp_slope, ramp[1], row_abs)
        elif RAMP_SYMMETRIC:   # measured from each row's nearest key (_ramp_logit2)
            near = _ramp_nearest_key(offs_m_abs, Nk - 1 + k_offset, k_offset)
            m_i += _ramp_nearest_row_term(offs_m_abs, near, ramp_slope, ramp[1], row_abs)
    if SCALED_SCORE:
        # a logit past float32's range (q.k finite, q.k * qk_scale not): m is inf, and P, one
        # FFMA against it (_attn_fwd_inner), is 0 where exp2(inf - inf) was NaN; the row is NaN
        # as it was (a row that a NaN reached, for the backward), not a silent 0
        l_i = tl.where(m_i == float("inf"), float("nan"), l_i)
    empty = l_i == 0.0  # no visible key: output 0 (m stays -inf, l 0)
    # where(): exactly 0 even when a hidden key's V holds inf or NaN (P @ V is 0 * inf there)
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    o_head = off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_om
    if STORE_O32:
        tl.store(O32 + o_head + offs_m[:, None] * stride_om + offs_d[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :])
    tl.store(O + o_head + offs_m[:, None] * stride_om + offs_d[None, :],
             _lowp(out, O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Mrow + pid_bh.to(tl.int64) * rows_all + q_start + offs_m, m_i, mask=row_ok)
    tl.store(Lrow + pid_bh.to(tl.int64) * rows_all + q_start + offs_m, l_i, mask=row_ok)
